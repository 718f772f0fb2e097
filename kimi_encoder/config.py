"""Configuration of the vision tower and of the image preprocessing.

Both are plain frozen dataclasses with their defaults on the fields. They are
read from an original-format Kimi checkpoint directory (``config.json`` and
``preprocessor_config.json``) or looked up by preset name.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

Variant = Literal["k3", "k25"]
FillStage = Literal["after_resize", "before_resize"]

# Fields of the checkpoint's `vision_config` (sglang / original names) -> ours.
# The processor's config in a checkpoint: its `media_proc_cfg` (REFERENCE.md).
PREPROCESSOR_FILE = "preprocessor_config.json"

_ORIGINAL_VISION_KEYS = {
    "patch_size": "patch_size",
    "vt_hidden_size": "hidden_size",
    "vt_num_hidden_layers": "num_layers",
    "vt_num_attention_heads": "num_heads",
    "vt_intermediate_size": "intermediate_size",
    "qkv_hidden_size": "qkv_hidden_size",
    "init_pos_emb_height": "pos_emb_height",
    "init_pos_emb_width": "pos_emb_width",
    "init_pos_emb_time": "pos_emb_time",
    "pos_emb_interpolation_mode": "pos_emb_interpolation_mode",
    "merge_kernel_size": "merge_kernel_size",
    "norm_type": "norm_type",
    "attn_bias": "attn_bias",
    "linear_bias": "linear_bias",
    "patch_embed_proj_bias": "patch_embed_proj_bias",
    "activation_func": "activation",
    "mm_hidden_size": "mm_hidden_size",
    "mm_projector_type": "projector_type",
    "projector_hidden_act": "projector_hidden_act",
    "projector_ln_eps": "projector_ln_eps",
    "text_hidden_size": "text_hidden_size",
}

# Fields of transformers' `Kimi_K25VisionConfig` -> ours.
_TRANSFORMERS_K25_VISION_KEYS = {
    "patch_size": "patch_size",
    "hidden_size": "hidden_size",
    "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads",
    "intermediate_size": "intermediate_size",
    "pos_emb_height": "pos_emb_height",
    "pos_emb_width": "pos_emb_width",
    "pos_emb_time": "pos_emb_time",
    "merge_kernel_size": "merge_kernel_size",
    "hidden_act": "activation",
}


@dataclass(frozen=True)
class VisionConfig:
    """MoonViT3d tower + projector. Defaults are Kimi-K3's."""

    patch_size: int = 14
    hidden_size: int = 1024
    num_layers: int = 27
    num_heads: int = 12
    # K3 attends in a wider space than the residual stream (head_dim 128).
    qkv_hidden_size: int = 1536
    intermediate_size: int = 4096
    pos_emb_height: int = 64
    pos_emb_width: int = 64
    pos_emb_time: int = 4
    pos_emb_interpolation_mode: str = "bilinear"
    merge_kernel_size: tuple[int, int] = (2, 2)
    norm_type: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    attn_bias: bool = False
    linear_bias: bool = False
    patch_embed_proj_bias: bool = False
    activation: str = "gelu_pytorch_tanh"
    mm_hidden_size: int = 1024
    projector_type: Literal["patchmergerv2", "patchmerger"] = "patchmergerv2"
    projector_hidden_act: str = "gelu"
    projector_ln_eps: float = 1e-5
    text_hidden_size: int = 7168
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "merge_kernel_size", tuple(self.merge_kernel_size))
        if self.norm_type not in ("rmsnorm", "layernorm"):
            raise ValueError(
                f"Unsupported vision norm_type {self.norm_type!r}; allowed: 'rmsnorm' (Kimi-K3), "
                "'layernorm' (Kimi-K2.5). Fix vision_config.norm_type in config.json."
            )
        if self.projector_type not in ("patchmergerv2", "patchmerger"):
            raise ValueError(
                f"Unsupported mm_projector_type {self.projector_type!r}; allowed: 'patchmergerv2' "
                "(Kimi-K3), 'patchmerger' (Kimi-K2.5). Fix vision_config.mm_projector_type."
            )
        if self.activation not in ("gelu_pytorch_tanh", "gelu"):
            raise ValueError(
                f"Unsupported vision activation {self.activation!r}; allowed: "
                "'gelu_pytorch_tanh', 'gelu'."
            )
        if self.qkv_hidden_size % self.num_heads or (self.qkv_hidden_size // self.num_heads) % 4:
            raise ValueError(
                f"qkv_hidden_size {self.qkv_hidden_size} must split into {self.num_heads} heads "
                "whose width is a multiple of 4 (2-D rotary embedding)."
            )
        if self.pos_emb_interpolation_mode not in ("bilinear", "bicubic"):
            raise ValueError(
                f"Unsupported pos_emb_interpolation_mode {self.pos_emb_interpolation_mode!r}; "
                "allowed: 'bilinear' (Kimi-K3), 'bicubic' (Kimi-K2.5)."
            )

    @property
    def variant(self) -> Variant:
        return "k3" if self.projector_type == "patchmergerv2" else "k25"

    @property
    def head_dim(self) -> int:
        return self.qkv_hidden_size // self.num_heads

    @property
    def merge_area(self) -> int:
        return self.merge_kernel_size[0] * self.merge_kernel_size[1]

    def num_tokens(self, grid: tuple[int, int, int]) -> int:
        """LLM tokens (feature rows) of an image of ``grid`` (t, h, w): one per merge block.

        >>> VisionConfig().num_tokens((1, 78, 138))
        2691
        """
        _, h, w = grid
        kh, kw = self.merge_kernel_size
        return (h // kh) * (w // kw)

    @classmethod
    def k25(cls, **dims: Any) -> VisionConfig:
        """A Kimi-K2.5-layout tower of the given dims (LayerNorm with biases, qkv and
        projector widths equal to ``hidden_size``, bicubic position interpolation)."""
        hidden = dims.get("hidden_size", 1152)
        return cls(
            **{
                "qkv_hidden_size": hidden,
                "mm_hidden_size": hidden,
                **_K25_ORIGINAL_DEFAULTS,
                **dims,
            }
        )

    def summary(self) -> dict[str, Any]:
        """The dims a client needs to place features: variant, widths, patch and merge sizes."""
        return {
            "variant": self.variant,
            "hidden_size": self.hidden_size,
            "num_layers": self.num_layers,
            "text_hidden_size": self.text_hidden_size,
            "patch_size": self.patch_size,
            "merge_kernel_size": list(self.merge_kernel_size),
        }

    @classmethod
    def from_checkpoint_config(cls, config: dict[str, Any]) -> VisionConfig:
        """Build from a checkpoint's parsed ``config.json``.

        Accepts the original Kimi layout (``vision_config`` with ``vt_*`` names,
        as sglang reads it) and transformers' ``kimi_k25`` layout
        (``Kimi_K25VisionConfig`` plus top-level ``projection_*``).
        ``text_hidden_size`` always follows ``text_config.hidden_size``.
        """
        vision = config.get("vision_config")
        if not isinstance(vision, dict):
            raise ValueError(
                "config.json has no 'vision_config' object; expected a Kimi-K3 or Kimi-K2.5 "
                "checkpoint config. Point the checkpoint at the model's directory."
            )
        text_hidden = (config.get("text_config") or {}).get("hidden_size")
        if "vt_hidden_size" in vision:
            is_k3 = vision.get("mm_projector_type", "patchmergerv2") == "patchmergerv2"
            values = {} if is_k3 else _K25_ORIGINAL_DEFAULTS.copy()
            for src, dst in _ORIGINAL_VISION_KEYS.items():
                if vision.get(src) is not None:
                    values[dst] = vision[src]
            values.setdefault("mm_hidden_size", values.get("hidden_size", cls.hidden_size))
            values.setdefault("qkv_hidden_size", values.get("hidden_size", cls.hidden_size))
        elif "hidden_size" in vision:
            values = _K25_ORIGINAL_DEFAULTS.copy()
            for src, dst in _TRANSFORMERS_K25_VISION_KEYS.items():
                if vision.get(src) is not None:
                    values[dst] = vision[src]
            values["qkv_hidden_size"] = values["hidden_size"]
            values["mm_hidden_size"] = config.get("projection_hidden_size") or values["hidden_size"]
            if config.get("projection_layer_norm_eps") is not None:
                values["projector_ln_eps"] = config["projection_layer_norm_eps"]
        else:
            raise ValueError(
                "vision_config has neither 'vt_hidden_size' (original Kimi layout) nor "
                "'hidden_size' (transformers kimi_k25 layout); cannot read the tower's shape."
            )
        if text_hidden is not None:
            values["text_hidden_size"] = text_hidden
        return cls(**values)

    def to_checkpoint_config(self) -> dict[str, Any]:
        """The ``vision_config`` block of an original-format checkpoint."""
        out = {src: getattr(self, dst) for src, dst in _ORIGINAL_VISION_KEYS.items()}
        out["merge_kernel_size"] = list(self.merge_kernel_size)
        out.update(pos_emb_type="divided_fixed", merge_type="sd2_tpool", mlp_type="mlp2")
        return out


# Kimi-K2.5 values of the fields its original config.json leaves out.
_K25_ORIGINAL_DEFAULTS: dict[str, Any] = dict(
    norm_type="layernorm",
    attn_bias=True,
    linear_bias=True,
    patch_embed_proj_bias=True,
    pos_emb_interpolation_mode="bicubic",
    projector_type="patchmerger",
)


@dataclass(frozen=True)
class PreprocessConfig:
    """The checkpoint's ``media_proc_cfg``. Defaults are Kimi-K3's."""

    patch_size: int = 14
    merge_kernel_size: int = 2
    in_patch_limit: int = 65536
    patch_limit_on_one_side: int = 512
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    transparent_bg_config: dict[str, Any] | None = field(
        default_factory=lambda: dict(_K3_BACKGROUND)
    )
    transparent_bg_fill_stage: FillStage = "after_resize"
    # Present in K3 configs and usually null; when set it overrides the token count.
    fixed_output_tokens: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "image_mean", tuple(float(v) for v in self.image_mean))
        object.__setattr__(self, "image_std", tuple(float(v) for v in self.image_std))
        if len(self.image_mean) != 3 or len(self.image_std) != 3:
            raise ValueError(
                f"image_mean and image_std need 3 values each, got {self.image_mean} and "
                f"{self.image_std}; fix media_proc_cfg in preprocessor_config.json."
            )
        if any(s <= 0 or not math.isfinite(s) for s in self.image_std):
            raise ValueError(f"image_std must be positive and finite, got {self.image_std}.")
        if self.transparent_bg_fill_stage not in ("after_resize", "before_resize"):
            raise ValueError(
                f"Unsupported transparent_bg_fill_stage {self.transparent_bg_fill_stage!r}; "
                "allowed: 'after_resize', 'before_resize'."
            )
        bg = self.transparent_bg_config
        if bg is not None:
            pattern = bg.get("pattern", "black")
            if pattern not in BACKGROUND_PATTERNS:
                raise ValueError(
                    f"Invalid background pattern: {pattern}; allowed: "
                    f"{', '.join(BACKGROUND_PATTERNS)}. Fix transparent_bg_config.pattern."
                )
        for name in (
            "patch_size",
            "merge_kernel_size",
            "in_patch_limit",
            "patch_limit_on_one_side",
        ):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)}.")

    @classmethod
    def from_media_proc_cfg(cls, cfg: dict[str, Any]) -> PreprocessConfig:
        names = {f for f in cls.__dataclass_fields__}
        values = {k: v for k, v in cfg.items() if k in names}
        if "transparent_bg_config" not in cfg:
            values["transparent_bg_config"] = None
        return cls(**values)

    def to_media_proc_cfg(self) -> dict[str, Any]:
        out = asdict(self)
        out["image_mean"] = list(self.image_mean)
        out["image_std"] = list(self.image_std)
        return out


BACKGROUND_PATTERNS = ("black", "white", "gray", "chessboard")
_K3_BACKGROUND = {
    "pattern": "chessboard",
    "chessboard_square_size": 8,
    "chessboard_square_on_top_left": True,
    "chessboard_white_value": 255,
    "chessboard_gray_value": 180,
}


@dataclass(frozen=True)
class Preset:
    name: str
    vision: VisionConfig
    preprocess: PreprocessConfig
    description: str


_K25_VISION = VisionConfig.k25(
    hidden_size=1152, num_layers=27, num_heads=16, intermediate_size=4304
)

PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            "tiny",
            VisionConfig(
                hidden_size=64,
                num_layers=2,
                num_heads=4,
                qkv_hidden_size=96,
                intermediate_size=128,
                pos_emb_height=16,
                pos_emb_width=16,
                mm_hidden_size=64,
                text_hidden_size=80,
            ),
            PreprocessConfig(in_patch_limit=1024, patch_limit_on_one_side=64),
            "K3-shaped, 2 layers of width 64: CPU tests and demos",
        ),
        Preset(
            "small",
            VisionConfig(
                hidden_size=384,
                num_layers=6,
                num_heads=4,
                qkv_hidden_size=512,
                intermediate_size=1536,
                pos_emb_height=64,
                pos_emb_width=64,
                mm_hidden_size=384,
                text_hidden_size=1024,
            ),
            PreprocessConfig(in_patch_limit=4096, patch_limit_on_one_side=128),
            "K3-shaped mid-size model (17.5M parameters): CPU benchmarks",
        ),
        Preset("k3", VisionConfig(), PreprocessConfig(), "Kimi-K3 vision tower, full size"),
        Preset(
            "k25",
            _K25_VISION,
            PreprocessConfig(in_patch_limit=16384),
            "Kimi-K2.5 vision tower, full size",
        ),
    )
}


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(
            f"Unknown preset {name!r}; valid presets: {', '.join(PRESETS)}. "
            "Pass one of these or a checkpoint directory."
        ) from None


def read_checkpoint_configs(path: str | Path) -> tuple[VisionConfig, PreprocessConfig]:
    """Read ``config.json`` and ``preprocessor_config.json`` from a checkpoint directory."""
    root = Path(path)
    config_file = root / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(
            f"No config.json in checkpoint directory {str(root)!r}; expected an original-format "
            f"Kimi-K3/K2.5 checkpoint, or a preset name ({', '.join(PRESETS)})."
        )
    vision = VisionConfig.from_checkpoint_config(json.loads(config_file.read_text()))
    proc_file = root / PREPROCESSOR_FILE
    if not proc_file.is_file():
        raise FileNotFoundError(
            f"No preprocessor_config.json in {str(root)!r}; the resize limits and normalization "
            "must come from the checkpoint (media_proc_cfg), they are never guessed."
        )
    proc = json.loads(proc_file.read_text())
    media = proc.get("media_proc_cfg", proc)
    preprocess = PreprocessConfig.from_media_proc_cfg(media)
    if preprocess.patch_size != vision.patch_size:
        raise ValueError(
            f"preprocessor patch_size {preprocess.patch_size} differs from the tower's "
            f"{vision.patch_size}; the checkpoint's two config files disagree."
        )
    return vision, preprocess


def resolve_configs(checkpoint: str | Path) -> tuple[VisionConfig, PreprocessConfig, str]:
    """(vision, preprocess, model name) for a preset name, a checkpoint directory or a
    hub checkpoint (``hf://REPO[@REVISION]``: its two config files, no weights)."""
    text = str(checkpoint)
    if text in PRESETS:
        preset = PRESETS[text]
        return preset.vision, preset.preprocess, f"preset:{text}"
    if text.startswith("hf://"):
        from .hub import HubRef, config_dir  # the hub client only where one is named

        ref = HubRef.parse(text)
        vision, preprocess = read_checkpoint_configs(config_dir(ref))
        return vision, preprocess, ref.repo_id
    if Path(text).is_dir():
        vision, preprocess = read_checkpoint_configs(text)
        return vision, preprocess, Path(text).resolve().name
    raise ValueError(
        f"Checkpoint {text!r} is neither a directory, a hub repository (hf://OWNER/NAME"
        f"[@REVISION]) nor a preset; valid presets: {', '.join(PRESETS)}."
    )
