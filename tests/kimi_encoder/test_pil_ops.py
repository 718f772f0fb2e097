"""Bit-exactness of ``kimi_encoder.pil_ops`` against Pillow itself, on the seeded images
of ``tests/images.py`` in every mode and variant the port covers."""

from __future__ import annotations

import platform
import warnings

import numpy as np
import pytest
import torch
from images import make_image
from PIL import Image
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from kimi_encoder.pil_ops import RawImage, raw_from_pil, resize_bicubic, to_rgb

KINDS = [
    "1", "1-trns", "L", "L-trns", "LA", "P", "P-trns-index", "P-trns-bytes", "P-rgba",
    "P-rgba-trns-index", "PA", "RGB", "RGB-trns", "RGBA", "CMYK", "I;16",
    "I;16-trns", "I", "I-trns", "F",
]  # fmt: skip

# (source size, target size), all (width, height).
RESIZES = [
    ((64, 48), (128, 96)),  # 2x upscale
    ((37, 29), (100, 71)),  # non-integer upscale
    ((200, 150), (20, 15)),  # 10x downscale
    ((120, 80), (97, 161)),  # downscale x, upscale y
    ((100, 37), (98, 37)),  # horizontal pass only
    ((37, 100), (37, 98)),  # vertical pass only
    ((101, 67), (64, 43)),  # small non-integer downscale
    ((1, 50), (7, 13)),  # 1xN source
    ((50, 1), (13, 7)),  # Nx1 source
    ((1, 1), (5, 3)),  # single pixel
    ((33, 17), (1, 1)),  # to a single pixel
    ((10, 10), (3, 3)),  # nearest-neighbour rounding of the running sum
    ((60, 90), (70, 40)),  # height shrinks, width grows: vertical pass first
    ((80, 300), (70, 100)),  # height shrinks much more than width: vertical first
    ((80, 100), (70, 80)),  # shrinks by exactly twice as many rows: horizontal first
    ((45, 45), (45, 45)),  # unchanged
]
BIG_RESIZE = ((900, 700), (403, 313))

BACKGROUNDS = {
    "none": None,
    "white": {"pattern": "white"},
    "gray": {"pattern": "gray"},
    "black": {},
    "chessboard": {
        "pattern": "chessboard",
        "chessboard_square_size": 8,
        "chessboard_square_on_top_left": False,
        "chessboard_white_value": 250,
        "chessboard_gray_value": 180,
    },
}


def _size_id(resize: tuple[tuple[int, int], tuple[int, int]]) -> str:
    (w0, h0), (w1, h1) = resize
    return f"{w0}x{h0}-{w1}x{h1}"


# ----------------------------------------------------------------------------- references


def reference_to_rgb(img: Image.Image, bg_config: dict | None) -> np.ndarray:
    """The processor's conversion, in Pillow and numpy float32."""
    img = img.copy()  # convert("RGBA") writes palette alphas into the image
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # P + bytes transparency -> RGB warns
        if bg_config is None:
            return np.asarray(img.convert("RGB"))
        if img.mode == "RGB":
            return np.asarray(img)
        if "A" not in img.getbands() and "transparency" not in img.info:
            return np.asarray(img.convert("RGB"))
        rgba = np.asarray(img.convert("RGBA"))
    height, width = rgba.shape[:2]
    pattern = bg_config.get("pattern", "black")
    if pattern == "chessboard":
        square = bg_config.get("chessboard_square_size", 16)
        gray_parity = 1 if bg_config.get("chessboard_square_on_top_left", True) else 0
        bg = np.full((height, width, 3), bg_config.get("chessboard_white_value", 255), np.uint8)
        for y in range(0, height, square):
            for x in range(0, width, square):
                if (y // square + x // square) % 2 == gray_parity:
                    bg[y : y + square, x : x + square] = bg_config.get("chessboard_gray_value", 200)
    else:
        bg = np.full((height, width, 3), {"white": 255, "gray": 128, "black": 0}[pattern], np.uint8)
    alpha = rgba[:, :, 3:4].astype(np.float32) / 255.0
    return (alpha * rgba[:, :, :3] + (1 - alpha) * bg).astype(np.uint8)


def assert_same(got: torch.Tensor, expected: np.ndarray, what: str) -> None:
    assert got.device.type == "cpu"
    got_np = got.numpy()
    assert got_np.dtype == expected.dtype, what
    assert got_np.shape == expected.shape, what
    if not np.array_equal(got_np, expected, equal_nan=got_np.dtype.kind == "f"):
        diff = np.abs(got_np.astype(np.float64) - expected.astype(np.float64))
        raise AssertionError(f"{what}: max abs diff {diff.max()}, {np.mean(diff == 0):.4%} exact")


# ----------------------------------------------------------------------------- tests


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """These tensors are small: intra-op threads only add overhead on a busy CPU."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def test_raw_from_pil_layout():
    for kind in KINDS:
        img = make_image(kind, (9, 5))
        raw = raw_from_pil(img)
        expected = np.asarray(img)
        assert raw.mode == img.mode
        assert raw.pixels.numpy().dtype == expected.dtype, kind
        assert np.array_equal(raw.pixels.numpy(), expected), kind
        assert raw.size == img.size
        assert raw.transparency == img.info.get("transparency")
        if img.mode in ("P", "PA"):
            channels = 4 if img.palette.mode == "RGBA" else 3
            assert tuple(raw.palette.shape) == (256, channels)
            assert raw.palette.dtype == torch.uint8
        else:
            assert raw.palette is None


@pytest.mark.parametrize("resize", [*RESIZES, BIG_RESIZE], ids=_size_id)
@pytest.mark.parametrize("kind", KINDS)
def test_resize_and_to_rgb_match_pillow(kind: str, resize):
    source, target = resize
    img = make_image(kind, source, seed=source[0])
    raw = resize_bicubic(raw_from_pil(img), target)
    resized = img.resize(target, Image.BICUBIC)
    assert raw.mode == resized.mode
    assert_same(raw.pixels, np.asarray(resized), f"resize {kind}")
    for name, bg_config in BACKGROUNDS.items():
        assert_same(to_rgb(raw, bg_config), reference_to_rgb(resized, bg_config), f"rgb {name}")


@pytest.mark.skipif(
    platform.machine().lower() not in ("x86_64", "amd64"),
    reason="Pillow's int32 overflow result is the x86 conversion's INT_MIN",
)
def test_resize_int32_overshoot_matches_pillow():
    img = make_image("I-extreme", (64, 40), seed=3)
    for target in [(97, 61), (23, 17)]:
        got = resize_bicubic(raw_from_pil(img), target).pixels
        assert_same(got, np.asarray(img.resize(target, Image.BICUBIC)), f"I {target}")


def test_float_resize_keeps_non_finite_values_local():
    values = np.linspace(-1, 1, 30 * 20, dtype=np.float32).reshape(20, 30)
    values[0, 0], values[19, 29], values[10, 15] = np.inf, -np.inf, np.nan
    img = Image.frombytes("F", (30, 20), values.tobytes())
    got = resize_bicubic(raw_from_pil(img), (41, 13)).pixels
    assert_same(got, np.asarray(img.resize((41, 13), Image.BICUBIC)), "F non-finite")


@pytest.mark.parametrize("background", list(BACKGROUNDS))
def test_composite_every_alpha_and_value(background: str):
    """All 256 x 256 (alpha, colour) pairs, for each background."""
    alpha, value = np.mgrid[0:256, 0:256].astype(np.uint8)
    rgba = np.stack([value, 255 - value, value // 2, alpha], axis=-1)
    got = to_rgb(RawImage(torch.from_numpy(rgba), "RGBA"), BACKGROUNDS[background])
    assert_same(got, reference_to_rgb(Image.fromarray(rgba), BACKGROUNDS[background]), background)


def test_chessboard_geometry():
    transparent = RawImage(torch.zeros(40, 40, 4, dtype=torch.uint8), "RGBA")
    board = to_rgb(transparent, {"pattern": "chessboard"})[..., 0]  # the defaults
    assert board[0, 0] == 255
    assert board[15, 15] == 255
    assert board[0, 16] == 200
    assert board[16, 0] == 200
    assert board[16, 16] == 255
    flipped = to_rgb(
        transparent,
        {
            "pattern": "chessboard",
            "chessboard_square_size": 3,
            "chessboard_square_on_top_left": False,
            "chessboard_white_value": 240,
            "chessboard_gray_value": 100,
        },
    )
    rows, cols = np.mgrid[0:40, 0:40]
    expected = np.where((rows // 3 + cols // 3) % 2 == 0, 100, 240).astype(np.uint8)
    assert np.array_equal(flipped.numpy(), np.repeat(expected[..., None], 3, axis=-1))


def test_rgb_passes_through_even_with_transparency():
    img = make_image("RGB-trns", (12, 7))
    raw = raw_from_pil(img)
    assert to_rgb(raw, {"pattern": "white"}) is raw.pixels


def test_invalid_pattern_raises():
    raw = raw_from_pil(make_image("RGBA", (8, 8)))
    with pytest.raises(ValueError, match="Invalid background pattern: stripes"):
        to_rgb(raw, {"pattern": "stripes"})


class _InputDtypes(TorchDispatchMode):
    """Records, for every aten op run, the dtypes of its tensor inputs."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, set[torch.dtype]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        leaves = pytree.tree_leaves((args, kwargs or {}))
        self.calls.append((str(func), {t.dtype for t in leaves if isinstance(t, torch.Tensor)}))
        return func(*args, **(kwargs or {}))


# Ops that only relabel memory (no kernel), and the few that CUDA runs on bool masks.
_METADATA_OPS = {
    "aten.view.dtype", "aten.view.default", "aten.detach.default", "aten.select.int",
    "aten.lift_fresh.default", "aten.expand.default",
}  # fmt: skip
_BOOL_OPS = _METADATA_OPS | {"aten.where.self", "aten.bitwise_or.Tensor", "aten._to_copy.default"}


@pytest.mark.parametrize("kind", ["I;16", "I;16-trns", "1", "1-trns"])
def test_no_arithmetic_on_uint16_or_bool(kind: str):
    """CUDA has few uint16/bool kernels: those dtypes only meet relabelling ops (and
    bool masks where/or/casts), even though the results keep Pillow's pixel types."""
    log = _InputDtypes()
    with log:
        for source, target in RESIZES:
            raw = resize_bicubic(raw_from_pil(make_image(kind, source, seed=2)), target)
            for bg_config in BACKGROUNDS.values():
                to_rgb(raw, bg_config)
    assert raw.pixels.dtype == (torch.bool if kind.startswith("1") else torch.uint16)
    uint16_ops = {op for op, dtypes in log.calls if torch.uint16 in dtypes}
    bool_ops = {op for op, dtypes in log.calls if torch.bool in dtypes}
    assert uint16_ops <= _METADATA_OPS, sorted(uint16_ops - _METADATA_OPS)
    assert bool_ops <= _BOOL_OPS, sorted(bool_ops - _BOOL_OPS)


def test_unsupported_mode_names_the_supported_ones():
    img = Image.new("YCbCr", (4, 3))
    with pytest.raises(ValueError, match="Unsupported image mode: YCbCr; the torch port handles"):
        raw_from_pil(img)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_matches_pillow(kind: str):
    for source, target in [*RESIZES, BIG_RESIZE]:
        img = make_image(kind, source, seed=source[0])
        raw = resize_bicubic(raw_from_pil(img, device="cuda"), target)
        assert raw.pixels.device.type == "cuda"
        resized = img.resize(target, Image.BICUBIC)
        assert_same(raw.pixels.cpu(), np.asarray(resized), f"resize {kind} {target}")
        for name, bg_config in BACKGROUNDS.items():
            got = to_rgb(raw, bg_config)
            assert got.device.type == "cuda"
            assert_same(got.cpu(), reference_to_rgb(resized, bg_config), f"rgb {name}")
