"""Build and run transformers' Kimi-K2.5 reference (``transformers/models/kimi_k25``) on CPU.

Used only by ``test_parity_k25.py``. The checkpoint directory holds our
original-format weights (``vision_tower.encoder.blocks.0.wqkv.weight``, ...)
next to a transformers-layout ``config.json``; transformers loads it through
its own ``from_pretrained`` and so through its own key conversion
(``conversion_mapping.py``, entry ``kimi_k25``: renames, qkv unfuse, rope
permutation). Nothing here renames a key by hand.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from pathlib import Path

import torch

from kimi_encoder.config import PreprocessConfig, VisionConfig

# A one-layer, dense, tiny DeepSeek-V3 text model: only its hidden size matters
# (the projector's output width); its weights are absent from the checkpoint.
_TINY_TEXT = dict(
    model_type="deepseek_v3",
    vocab_size=64,
    intermediate_size=32,
    moe_intermediate_size=16,
    num_hidden_layers=1,
    first_k_dense_replace=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    n_routed_experts=2,
    n_shared_experts=1,
    num_experts_per_tok=1,
    n_group=1,
    topk_group=1,
    kv_lora_rank=16,
    q_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=8,
    max_position_embeddings=128,
)


def transformers_config(vision: VisionConfig) -> dict:
    """``config.json`` in transformers' ``kimi_k25`` layout for our K2.5 ``VisionConfig``."""
    if vision.variant != "k25" or vision.qkv_hidden_size != vision.hidden_size:
        raise ValueError(f"not a Kimi-K2.5-shaped vision config: {vision}")
    return {
        "architectures": ["Kimi_K25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "dtype": "float32",
        "projection_hidden_size": vision.mm_hidden_size,
        "projection_layer_norm_eps": vision.projector_ln_eps,
        "text_config": dict(_TINY_TEXT, hidden_size=vision.text_hidden_size),
        "vision_config": {
            "model_type": "kimi_k25_vision",
            "patch_size": vision.patch_size,
            "hidden_size": vision.hidden_size,
            "num_hidden_layers": vision.num_layers,
            "num_attention_heads": vision.num_heads,
            "intermediate_size": vision.intermediate_size,
            "pos_emb_height": vision.pos_emb_height,
            "pos_emb_width": vision.pos_emb_width,
            "pos_emb_time": vision.pos_emb_time,
            "merge_kernel_size": list(vision.merge_kernel_size),
            "hidden_act": vision.activation,
            "rope_parameters": {"rope_type": "axial", "rope_theta": vision.rope_theta},
        },
    }


def write_transformers_config(checkpoint: Path, vision: VisionConfig) -> None:
    """Replace ``config.json`` (the original layout) with transformers' ``kimi_k25`` one."""
    text = json.dumps(transformers_config(vision), indent=2) + "\n"
    (checkpoint / "config.json").write_text(text)


@contextlib.contextmanager
def _quiet_transformers():
    """Silence transformers' notes about the (absent) language-model weights."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


def load_reference(checkpoint: str | Path):
    """``Kimi_K25ForConditionalGeneration`` from ``checkpoint`` (float32, CPU, eval).

    The full conditional-generation model is built (its text model is one tiny
    dense layer) because ``from_pretrained`` of that class is what applies the
    ``kimi_k25`` key conversion. Returns ``(model, loading_info)``.
    """
    from transformers import Kimi_K25ForConditionalGeneration

    with _quiet_transformers():
        model, info = Kimi_K25ForConditionalGeneration.from_pretrained(
            str(checkpoint),
            dtype=torch.float32,
            attn_implementation="sdpa",
            output_loading_info=True,
        )
    return model.eval(), info


@torch.inference_mode()
def reference_features(model, pixels: torch.Tensor, grids: torch.Tensor) -> list[torch.Tensor]:
    """transformers' image-features path: ``get_image_features(pixel_values, image_grid_thw)``."""
    out = model.get_image_features(pixel_values=pixels, image_grid_thw=grids, return_dict=True)
    return list(out.pooler_output)


def load_image_processor(preprocess: PreprocessConfig):
    """transformers' ``Kimi_K25ImageProcessor`` set to our ``media_proc_cfg``.

    The processor is a torchvision backend. PyPI's torchvision wheels are built
    against PyPI's torch, and their C++ ops fail to load next to torch's ``+cpu``
    build (RuntimeError, not ImportError): the tests that need it are marked
    ``torchvision`` and run in ``.venv-k25``, where the two are pinned as a pair.
    """
    try:
        from transformers.models.kimi_k25.image_processing_kimi_k25 import Kimi_K25ImageProcessor
    except (ImportError, RuntimeError) as exc:  # no torchvision, or one built for another torch
        raise RuntimeError(
            f"Kimi_K25ImageProcessor needs a torchvision that loads beside torch "
            f"{torch.__version__} ({type(exc).__name__}: {exc}); the tests marked "
            "`torchvision` run in .venv-k25 (`make k25-env`, then `.venv-k25/bin/python "
            "-m pytest -m torchvision tests/kimi_encoder/test_parity_k25.py`)"
        ) from exc
    side = preprocess.patch_limit_on_one_side
    processor = Kimi_K25ImageProcessor(
        max_patches=preprocess.in_patch_limit,
        size={"max_height": side, "max_width": side},
        patch_size=preprocess.patch_size,
        merge_size=preprocess.merge_kernel_size,
        image_mean=list(preprocess.image_mean),
        image_std=list(preprocess.image_std),
    )
    return processor
