"""Kimi-K2.5 parity with transformers' reference implementation (``models/kimi_k25``).

How the reference is built (see ``reference_k25.py``):

- ``write_checkpoint`` writes a seeded tiny K2.5 checkpoint with ORIGINAL key
  names (``vision_tower.encoder.blocks.0.wqkv.weight``, ``mm_projector.proj.0.weight``,
  ``mm_projector.pre_norm.weight``, ...); its ``config.json`` is then replaced by
  one in transformers' ``kimi_k25`` layout (``Kimi_K25VisionConfig`` plus a
  one-layer dense DeepSeek-V3 text config, whose weights are absent).
- transformers loads that directory with
  ``Kimi_K25ForConditionalGeneration.from_pretrained``: the lightest class whose
  ``from_pretrained`` applies the ``kimi_k25`` conversion mapping (renames,
  ``wqkv`` -> q/k/v unfuse, rope permutation of q and k). No key is renamed by
  hand; the test checks that only language-model weights were missing.
- Ours loads the same directory (``VisionEncoder.from_pretrained``, reading the
  transformers-layout ``config.json``).

Per image (``tests/images.py``, fixed seeds; sizes from 1x1 to large
downscaled, modes RGB, L, RGBA, P, P with transparency, LA, CMYK): our ``plan``
+ ``materialize`` give pixel values and the grid; the SAME tensors go through
transformers' ``get_image_features(pixel_values, image_grid_thw)`` and through
our model, and the features must agree to 1e-4 (float32, max abs), one image
at a time and all images in one varlen batch. Grids must equal those of transformers' own
``Kimi_K25ImageProcessor``. Its pixel values are compared too: where neither
side resizes (and no alpha is composited) they must agree to 1e-6; elsewhere
the processors differ by design (transformers converts to RGB first and resizes
with torchvision's antialiased bicubic, ours resizes with PIL in the image's own
mode), so the difference is only recorded (``record_property`` and stdout).
The processor needs torchvision, which does not load beside the main environment's CPU
build of torch: those cases are marked ``torchvision`` and ``make test`` runs them in an
environment of their own (``.venv-k25``, ``make k25-env``: torch and torchvision pinned
as a pair); the other passes deselect them.

The preprocessing uses a white transparent background, which is what
transformers' ``convert_to_rgb`` composites on, so that alpha images measure
rounding rather than a different background choice.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import pytest
import torch
from images import image_bytes
from PIL import Image
from safetensors import safe_open

pytest.importorskip("transformers")

import reference_k25 as ref

from kimi_encoder.config import PreprocessConfig, VisionConfig
from kimi_encoder.encoder import VisionEncoder
from kimi_encoder.weights import write_checkpoint

FEATURE_TOL = 1e-4
PIXEL_TOL = 1e-6
SEED = 1234

# Tiny K2.5-shaped tower: LayerNorm with biases, qkv width == hidden, bicubic pos-emb.
VISION = VisionConfig.k25(
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    intermediate_size=128,
    pos_emb_height=16,
    pos_emb_width=16,
    text_hidden_size=80,
)
PREPROCESS = PreprocessConfig(
    in_patch_limit=1024,
    patch_limit_on_one_side=64,
    transparent_bg_config={"pattern": "white"},
)


# --- images (tests/images.py: seeded, every PIL mode) ------------------------------------


@dataclass(frozen=True)
class Case:
    id: str
    mode: str
    width: int
    height: int
    seed: int
    # Neither side resizes and no alpha is composited: pixel values must match.
    exact_pixels: bool

    def data(self) -> bytes:
        return image_bytes(self.mode, (self.width, self.height), self.seed)


CASES = [
    Case("rgb-1x1", "RGB", 1, 1, 0, True),
    Case("rgb-224-table-size", "RGB", 224, 224, 1, True),
    Case("rgb-101x37-padded", "RGB", 101, 37, 2, True),
    Case("l-90x90", "L", 90, 90, 3, True),
    Case("l-tall-thin-24x1400", "L", 24, 1400, 4, False),
    Case("rgb-wide-1500x40", "RGB", 1500, 40, 5, False),
    Case("rgb-large-1600x1200", "RGB", 1600, 1200, 6, False),
    Case("rgba-150x120", "RGBA", 150, 120, 7, False),
    Case("rgba-large-700x500", "RGBA", 700, 500, 8, False),
    Case("p-300x200", "P", 300, 200, 9, True),
    Case("p-transparency-640x480", "P-trns-index", 640, 480, 10, False),
    Case("la-64x48", "LA", 64, 48, 11, False),
    Case("cmyk-200x150", "CMYK", 200, 150, 12, True),
    Case("cmyk-large-640x480", "CMYK", 640, 480, 13, False),
]
IDS = [c.id for c in CASES]


# --- fixtures ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = write_checkpoint(tmp_path_factory.mktemp("k25"), VISION, PREPROCESS, seed=SEED)
    with safe_open(root / "model.safetensors", framework="pt") as f:
        keys = set(f.keys())
    original = {  # the published layout, which transformers must convert itself
        "vision_tower.encoder.blocks.0.wqkv.weight",
        "vision_tower.encoder.blocks.0.norm0.bias",
        "vision_tower.patch_embed.pos_emb.weight",
        "mm_projector.pre_norm.weight",
        "mm_projector.proj.0.weight",
    }
    assert original <= keys, f"not an original-format checkpoint: missing {original - keys}"
    ref.write_transformers_config(root, VISION)
    return root


@pytest.fixture(scope="module")
def reference(checkpoint):
    model, info = ref.load_reference(checkpoint)
    not_text = [
        k for k in info["missing_keys"] if not k.startswith(("model.language_model.", "lm_head."))
    ]
    assert not not_text, f"transformers left vision weights uninitialized: {not_text}"
    assert not info["unexpected_keys"], f"unconverted checkpoint keys: {info['unexpected_keys']}"
    assert not info["mismatched_keys"], f"mis-shaped after conversion: {info['mismatched_keys']}"
    return model


@pytest.fixture(scope="module")
def encoder(checkpoint):
    return VisionEncoder.from_pretrained(checkpoint, device="cpu", dtype="float32", backend="cpu")


@pytest.fixture(scope="module")
def processor():
    return ref.load_image_processor(PREPROCESS)


def _ours(encoder: VisionEncoder, data: bytes):
    item = encoder.plan(data)
    (pixels,) = encoder.materialize([item])
    return item, pixels


# --- tests -------------------------------------------------------------------------------


def test_config_round_trips_through_transformers_layout(encoder):
    """Our reader of the transformers-layout config.json recovers the written tower."""
    assert encoder.vision == VISION


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_features_match_transformers(case: Case, encoder, reference, record_property):
    item, pixels = _ours(encoder, case.data())
    grid = item.grid_thws  # (1, 3) int64
    with torch.inference_mode():
        ours = encoder.model(pixels, [item.grid])
        (theirs,) = ref.reference_features(reference, pixels, grid)
        (encoded,) = encoder.encode([item])
    assert ours.shape == theirs.shape == (VISION.num_tokens(item.grid), VISION.text_hidden_size)
    diff = (ours - theirs).abs().max().item()
    record_property("max_abs_feature_diff", diff)
    print(f"{case.id}: grid {item.grid} features max|ours - transformers| = {diff:.3e}")
    assert diff <= FEATURE_TOL, f"{case.id}: {diff:.3e} > {FEATURE_TOL}"
    assert torch.equal(encoded, ours), "encode() differs from model() on the same pixels"


def test_batched_features_match_transformers(encoder, reference):
    """All images in one varlen batch: attention must stay within each image."""
    items = [encoder.plan(c.data()) for c in CASES]
    pixels = encoder.materialize(items)
    grids = torch.cat([it.grid_thws for it in items])
    with torch.inference_mode():
        ours = encoder.forward(pixels, items)
        theirs = ref.reference_features(reference, torch.cat(pixels), grids)
    assert len(ours) == len(theirs) == len(CASES)
    diffs = {c.id: (a - b).abs().max().item() for c, a, b in zip(CASES, ours, theirs, strict=True)}
    print("batched max|ours - transformers|:", {k: f"{v:.2e}" for k, v in diffs.items()})
    assert max(diffs.values()) <= FEATURE_TOL, diffs


@pytest.mark.torchvision
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_grid_and_pixels_match_transformers_processor(
    case: Case, encoder, processor, record_property
):
    data = case.data()
    item, pixels = _ours(encoder, data)
    out = processor(images=[Image.open(io.BytesIO(data))], return_tensors="pt")
    assert out["image_grid_thw"].tolist() == item.grid_thws.tolist(), (
        f"{case.id}: transformers grid {out['image_grid_thw'].tolist()} vs ours "
        f"{item.grid_thws.tolist()}"
    )
    theirs = out["pixel_values"]
    assert theirs.shape == pixels.shape
    delta = (theirs - pixels).abs()
    diff = delta.max().item()
    record_property("max_abs_pixel_diff", diff)
    record_property("mean_abs_pixel_diff", delta.mean().item())
    print(
        f"{case.id}: grid {item.grid} pixels |ours - transformers| max {diff:.3e} "
        f"mean {delta.mean().item():.2e} "
        f"({'asserted' if case.exact_pixels else 'differs by design, recorded'})"
    )
    if case.exact_pixels:
        assert diff <= PIXEL_TOL, f"{case.id}: pixel values differ by {diff:.3e}"
