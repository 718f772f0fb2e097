"""Bit-exact torch ports of the two Pillow operations the reference processor runs.

``resize_bicubic`` reproduces ``img.resize(size, Image.BICUBIC)`` and ``to_rgb``
the processor's conversion to RGB (with optional alpha compositing), for images
still in their decoded Pillow mode. Everything runs with torch ops on the
device of the input tensors, so the same code serves CPU and GPU.

How Pillow resamples, and how this module matches it bit for bit:

* The filter is separable. For every output position Pillow picks a window of
  source pixels around ``center = (i + 0.5) * scale`` (``scale = in / out``),
  evaluates the a = -0.5 cubic at each tap (widened by ``scale`` when
  downscaling) and normalises the taps to sum to one, all in float64. The
  coefficient tables are rebuilt here with the same float64 operations in the
  same order, so they are identical to Pillow's.
* A pass is skipped when its dimension keeps its size. The horizontal pass
  runs first, unless (new in Pillow 13) the height shrinks by more than twice
  as many pixels as the width does: then the vertical one does. Each pass
  stores its result in the image's own pixel type, so the intermediate image
  is rounded and clipped, and the order matters.
* 8-bit images use fixed point: every coefficient becomes
  ``trunc(k * 2**22 +- 0.5)`` (``PRECISION_BITS = 32 - 8 - 2`` bits of
  fraction, leaving room for the sign and for the overshoot of the negative
  lobes), a pixel is ``(2**21 + sum(v * k)) >> 22`` clipped to [0, 255]. The
  sum is exact in int32, so the order of accumulation is free.
* ``I;16``, ``I`` and ``F`` images accumulate ``v * k`` in float64 starting
  from 0.0; float addition is not associative, so the taps are added one at a
  time in Pillow's order. ``I;16`` and ``I`` then round half away from zero
  (``I;16`` clipped to [0, 65535]); ``F`` is cast to float32.
* ``LA``/``RGBA`` are resized premultiplied (``La``/``RGBa``) with Pillow's
  integer conversions on both sides; ``P`` and ``1`` always use Pillow's
  nearest-neighbour scaling, whose source positions come from a running
  float64 sum.

The tensors a caller sees keep Pillow's pixel types (``uint16`` for ``I;16``,
``bool`` for ``1``), but CUDA has few kernels for those two: every operation
here computes on ``int32`` and ``uint8`` instead, and ``uint16`` data is only
ever reinterpreted (``Tensor.view``) from ``int16``, never computed on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import accumulate, repeat

import numpy as np
import torch
from PIL import Image, ImageMode

PRECISION_BITS = 32 - 8 - 2
"""Fraction bits of Pillow's fixed-point coefficients for 8-bit images."""

SUPPORTED_MODES = frozenset({"1", "L", "LA", "P", "PA", "RGB", "RGBA", "CMYK", "I;16", "I", "F"})
_NEAREST_MODES = frozenset({"1", "P"})
_PREMULTIPLIED_MODES = frozenset({"LA", "RGBA"})
_GRAY_MODES = frozenset({"1", "L", "I;16", "I", "F"})
_BICUBIC_SUPPORT = 2.0
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1

Transparency = int | tuple[int, ...] | bytes


@dataclass(frozen=True)
class RawImage:
    """A decoded image's own band data, in Pillow's mode, as a tensor.

    Attributes:
        pixels: ``torch.from_numpy(np.asarray(img))`` layout: (H, W) for
            single-band modes, (H, W, C) otherwise; uint8 (bool for ``1``,
            uint16 for ``I;16``, int32 for ``I``, float32 for ``F``).
        mode: The Pillow mode.
        palette: For ``P``/``PA``: (256, 3) uint8 for an RGB palette,
            (256, 4) for an RGBA one; entries past the palette's length are
            (0, 0, 0[, 255]) as in Pillow. ``None`` otherwise.
        transparency: ``img.info["transparency"]`` if present: a gray value
            (``1``/``L``/``I``/``I;16``), a palette index or per-index alpha
            bytes (``P``), or an RGB tuple (``RGB``).
    """

    pixels: torch.Tensor
    mode: str
    palette: torch.Tensor | None = None
    transparency: Transparency | None = None

    @property
    def size(self) -> tuple[int, int]:
        """(width, height), as ``PIL.Image.Image.size``."""
        return self.pixels.shape[1], self.pixels.shape[0]


def raw_from_pil(img: Image.Image, device: torch.device | str | None = None) -> RawImage:
    """Package a decoded Pillow image without converting it (host side)."""
    return raw_image(*raw_arrays(img), img.mode, img.info.get("transparency"), device)


def raw_arrays(img: Image.Image) -> tuple[np.ndarray, np.ndarray | None]:
    """A decoded image's band data as ``RawImage.pixels`` holds it, and its palette as
    ``RawImage.palette`` does (None unless ``P``/``PA``), as numpy arrays: what
    ``raw_image`` puts on a device, from this process or another one."""
    if img.mode not in SUPPORTED_MODES:
        raise ValueError(
            f"Unsupported image mode: {img.mode}; the torch port handles "
            f"{', '.join(sorted(SUPPORTED_MODES))}. Convert other modes with Pillow "
            "(preprocess.preprocess_gpu does)."
        )
    array = np.array(img)
    palette = None
    if img.mode in ("P", "PA"):
        entries = np.zeros((256, 4), dtype=np.uint8)
        entries[:, 3] = 255
        data = np.asarray(img.getpalette("RGBA") or [], dtype=np.uint8).reshape(-1, 4)
        entries[: len(data)] = data
        if img.palette is None or img.palette.mode != "RGBA":
            entries = entries[:, :3]
        palette = entries
    return array, palette


def raw_image(
    array: np.ndarray,
    palette: np.ndarray | None,
    mode: str,
    transparency: Transparency | None,
    device: torch.device | str | None = None,
) -> RawImage:
    """``raw_arrays``' output as a ``RawImage`` on ``device``."""
    if array.dtype == np.uint16:  # moved as int16 bits: CUDA copies int16 natively
        pixels = torch.from_numpy(array.view(np.int16)).to(device).view(torch.uint16)
    else:
        pixels = torch.from_numpy(array).to(device)
    if palette is not None:
        palette = torch.from_numpy(palette).to(device)
    return RawImage(pixels, mode, palette, transparency)


# --------------------------------------------------------------------------- resize


def resize_bicubic(raw: RawImage, size: tuple[int, int]) -> RawImage:
    """What ``img.resize(size, Image.BICUBIC)`` returns, bit for bit.

    ``size`` is (width, height). ``P`` and ``1`` images are scaled with
    nearest neighbour, as Pillow does whatever filter is asked for. The image
    is returned as is when the size does not change.
    """
    width, height = size
    if width < 1 or height < 1:
        raise ValueError("height and width must be > 0")
    if tuple(size) == raw.size:
        return raw
    palette = raw.palette
    pixel_type = raw.pixels.dtype
    pixels = _widen(raw.pixels)
    if raw.mode in _NEAREST_MODES:
        pixels = _resize_nearest(pixels, width, height)
    elif raw.mode in _PREMULTIPLIED_MODES:
        pixels = _unpremultiply(_resample(_premultiply(pixels), width, height, pixel_type))
    elif raw.mode in SUPPORTED_MODES:
        pixels = _resample(pixels, width, height, pixel_type)
        if raw.mode == "PA":
            # Pillow's resampler does not copy the palette: the result's is empty (black).
            palette = torch.zeros_like(raw.palette[:, :3])
    else:
        raise ValueError(f"Unsupported image mode: {raw.mode}")
    return RawImage(_narrow(pixels, pixel_type), raw.mode, palette, raw.transparency)


def _widen(pixels: torch.Tensor) -> torch.Tensor:
    """Pixels in a type CUDA computes on: ``uint16`` -> ``int32``, ``bool`` -> ``uint8``."""
    if pixels.dtype == torch.uint16:
        return pixels.view(torch.int16).to(torch.int32) & 0xFFFF
    if pixels.dtype == torch.bool:
        return pixels.to(torch.uint8)
    return pixels


def _narrow(pixels: torch.Tensor, pixel_type: torch.dtype) -> torch.Tensor:
    """``_widen`` undone: values already in range back to Pillow's pixel type."""
    if pixel_type == torch.uint16:
        wrapped = torch.where(pixels >= 1 << 15, pixels - (1 << 16), pixels)
        return wrapped.to(torch.int16).view(torch.uint16)
    if pixel_type == torch.bool:
        return pixels != 0
    return pixels


def _resize_nearest(pixels: torch.Tensor, width: int, height: int) -> torch.Tensor:
    rows = _nearest_indices(pixels.shape[0], height, pixels.device)
    cols = _nearest_indices(pixels.shape[1], width, pixels.device)
    return pixels.index_select(0, rows).index_select(1, cols)


def _nearest_indices(in_size: int, out_size: int, device: torch.device) -> torch.Tensor:
    """Source indices of Pillow's nearest-neighbour scaling along one axis.

    Pillow walks the source with a running float64 sum (start at half a step,
    add one step per pixel) and truncates; the rounding of that running sum
    decides ties such as 10 -> 3 pixels, so it is replayed exactly here. The
    table is small and built on the host. Positions stay inside the source for
    any size Pillow accepts (drift would need ~2**26 output pixels).
    """
    step = in_size / out_size
    positions = accumulate(repeat(step, out_size - 1), initial=step * 0.5)
    return torch.tensor([int(p) for p in positions], dtype=torch.int64, device=device)


def _resample(
    pixels: torch.Tensor, width: int, height: int, pixel_type: torch.dtype
) -> torch.Tensor:
    """Two-pass separable bicubic resampling, rounding as Pillow stores ``pixel_type``.

    ``pixels`` are widened (``_widen``): ``I;16`` data arrives and leaves as int32.
    """
    x = pixels if pixels.dim() == 3 else pixels.unsqueeze(-1)
    in_height, in_width = x.shape[:2]
    passes = [(1, width), (0, height)]
    if height < in_height and in_height - height > 2 * (in_width - width):
        passes.reverse()  # Pillow 13 goes vertical first when height shrinks much more
    for dim, out_size in passes:
        if out_size != x.shape[dim]:
            x = _resample_axis(x, dim, out_size, pixel_type)
    return x.reshape(height, width, *pixels.shape[2:])


def _resample_axis(
    x: torch.Tensor, dim: int, out_size: int, pixel_type: torch.dtype
) -> torch.Tensor:
    """One resampling pass of an (H, W, C) tensor along ``dim`` (0 or 1)."""
    index, weights, valid = _bicubic_coefficients(x.shape[dim], out_size, x.device)
    shape = [1, 1, 1]
    shape[dim] = out_size
    if pixel_type == torch.uint8:
        weights = _to_fixed_point(weights)
        source = x.to(torch.int32)
        acc: torch.Tensor | float = 1 << (PRECISION_BITS - 1)
    else:
        source = x.to(torch.float64)
        acc = 0.0
    for tap in range(index.shape[1]):
        term = source.index_select(dim, index[:, tap]) * weights[:, tap].view(shape)
        if pixel_type != torch.uint8:
            # Pillow never reads padding taps; 0 * inf would leak NaNs here.
            term = torch.where(valid[:, tap].view(shape), term, 0.0)
        acc = acc + term
    return _store(acc, pixel_type)


def _store(acc: torch.Tensor, pixel_type: torch.dtype) -> torch.Tensor:
    """Round an accumulated pass into the pixel type as Pillow does (``I;16`` kept as int32)."""
    if pixel_type == torch.uint8:
        return (acc >> PRECISION_BITS).clamp(0, 255).to(torch.uint8)
    if pixel_type == torch.float32:
        return acc.to(torch.float32)
    rounded = torch.where(acc >= 0, acc + 0.5, acc - 0.5).trunc()
    if pixel_type == torch.uint16:
        return rounded.clamp(0, 65535).to(torch.int32)
    if pixel_type == torch.int32:
        # The C cast of an out-of-range double yields INT_MIN on x86.
        overflow = (rounded < _INT32_MIN) | (rounded > _INT32_MAX)
        return torch.where(overflow, _INT32_MIN, rounded).to(torch.int32)
    raise ValueError(f"Unsupported pixel dtype: {pixel_type}")


def _bicubic_coefficients(
    in_size: int, out_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pillow's ``precompute_coeffs`` for the bicubic filter, on ``device``.

    Returns, each of shape (out_size, taps): source indices (int64, clamped
    into the image for padding taps), normalised float64 weights (0 on
    padding taps) and the mask of real taps.
    """
    scale = in_size / out_size
    filterscale = max(scale, 1.0)
    support = _BICUBIC_SUPPORT * filterscale
    taps = 2 * math.ceil(support) + 1
    f64 = {"dtype": torch.float64, "device": device}

    center = (torch.arange(out_size, **f64) + 0.5) * scale
    first = (center - support + 0.5).trunc().clamp(min=0)
    end = (center + support + 0.5).trunc().clamp(max=in_size)
    position = first.unsqueeze(1) + torch.arange(taps, **f64)
    valid = position < end.unsqueeze(1)
    offset = (position - center.unsqueeze(1) + 0.5) * (1.0 / filterscale)
    weights = torch.where(valid, _bicubic(offset), 0.0)

    total = torch.zeros(out_size, **f64)
    for tap in range(taps):  # sequential, like Pillow's running sum
        total = total + weights[:, tap]
    total = total.unsqueeze(1)
    weights = torch.where(total != 0, weights / total, weights)
    index = position.to(torch.int64).clamp(max=in_size - 1)
    return index, weights, valid


def _bicubic(x: torch.Tensor) -> torch.Tensor:
    """Keys' cubic convolution kernel with a = -0.5, in Pillow's operation order."""
    x = x.abs()
    inner = (1.5 * x - 2.5) * x * x + 1  # ((a + 2) x - (a + 3)) x^2 + 1
    outer = (((x - 5) * x + 8) * x - 4) * -0.5  # (((x - 5) x + 8) x - 4) a
    return torch.where(x < 1, inner, torch.where(x < 2, outer, 0.0))


def _to_fixed_point(weights: torch.Tensor) -> torch.Tensor:
    """float64 coefficients -> int32 with PRECISION_BITS fraction bits, rounded."""
    scaled = weights * (1 << PRECISION_BITS)
    return torch.where(weights < 0, scaled - 0.5, scaled + 0.5).trunc().to(torch.int32)


def _muldiv255(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Pillow's integer ``round(a * b / 255)`` for 8-bit operands (int32)."""
    t = a * b + 128
    return ((t >> 8) + t) >> 8


def _premultiply(pixels: torch.Tensor) -> torch.Tensor:
    """``LA``/``RGBA`` -> ``La``/``RGBa``: colour bands times alpha / 255."""
    alpha = pixels[..., -1:]
    color = _muldiv255(pixels[..., :-1].to(torch.int32), alpha.to(torch.int32))
    return torch.cat([color.to(torch.uint8), alpha], dim=-1)


def _unpremultiply(pixels: torch.Tensor) -> torch.Tensor:
    """``La``/``RGBa`` -> ``LA``/``RGBA``: ``min(255, 255 * c // a)`` unless a is 0 or 255."""
    alpha = pixels[..., -1:].to(torch.int32)
    color = pixels[..., :-1].to(torch.int32)
    divided = (255 * color).div(alpha.clamp(min=1), rounding_mode="floor").clamp(max=255)
    color = torch.where((alpha == 0) | (alpha == 255), color, divided)
    return torch.cat([color.to(torch.uint8), pixels[..., -1:]], dim=-1)


# --------------------------------------------------------------------------- to RGB


def to_rgb(raw: RawImage, bg_config: dict | None) -> torch.Tensor:
    """The processor's RGB conversion, as an (H, W, 3) uint8 tensor on the same device.

    ``RGB`` passes unchanged (even with a ``transparency`` entry). An image
    with an alpha band or a ``transparency`` entry is, when ``bg_config`` is
    given, converted as ``img.convert("RGBA")`` and composited on the
    configured background with float32 arithmetic:
    ``uint8(a * rgb + (1 - a) * bg)``, ``a = alpha / 255``. Everything else,
    and everything when ``bg_config`` is None, is ``img.convert("RGB")``.

    Raises:
        ValueError: for an unknown background pattern (only raised when an
            image is actually composited, as in the reference).
    """
    if raw.mode == "RGB":
        return raw.pixels
    rgb, alpha = _rgb_and_alpha(raw)
    if bg_config is None or alpha is None:
        return rgb
    height, width = rgb.shape[:2]
    background = _background(bg_config, height, width, rgb.device).float()
    # A device tensor as divisor: CUDA turns division by a host scalar into a
    # multiplication by its reciprocal, which is not always correctly rounded.
    a = alpha.unsqueeze(-1).float() / torch.full((), 255.0, device=rgb.device)
    out = a * rgb.float() + (1 - a) * background
    return out.clamp(0, 255).to(torch.uint8)


def _rgb_and_alpha(raw: RawImage) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``convert("RGB")`` and, for images with alpha data, the alpha band of ``convert("RGBA")``.

    The alpha is None when the image has neither an alpha band nor a
    ``transparency`` entry (the reference then never composites).
    """
    mode, pixels = raw.mode, raw.pixels
    has_alpha = "A" in ImageMode.getmode(mode).bands or raw.transparency is not None
    opaque = torch.full(pixels.shape[:2], 255, dtype=torch.uint8, device=pixels.device)
    if mode in _GRAY_MODES:
        gray = _gray_to_8bit(pixels, mode)
        rgb = gray.unsqueeze(-1).expand(*gray.shape, 3).contiguous()
        alpha = opaque
        if mode != "F" and isinstance(raw.transparency, int):
            # convert_transparent compares the 8-bit gray with the low byte.
            alpha = torch.where(gray == (raw.transparency & 0xFF), 0, opaque)
    elif mode == "LA":
        rgb = pixels[..., :1].expand(*pixels.shape[:2], 3).contiguous()
        alpha = pixels[..., 1]
    elif mode == "RGBA":
        rgb, alpha = pixels[..., :3], pixels[..., 3]
    elif mode == "CMYK":
        rgb, alpha = _cmyk_to_rgb(pixels), opaque
    elif mode == "PA":
        rgb, alpha = raw.palette[pixels[..., 0].long(), :3], pixels[..., 1]
    elif mode == "P":
        table = _palette_rgba(raw)
        rgba = table[pixels.long()]
        rgb, alpha = rgba[..., :3], rgba[..., 3]
    else:
        raise ValueError(f"Unsupported image mode: {mode}")
    return rgb, (alpha if has_alpha else None)


def _gray_to_8bit(pixels: torch.Tensor, mode: str) -> torch.Tensor:
    """Pillow's single-band -> ``L`` values (``I``/``I;16``/``F`` clamp, ``F`` truncates)."""
    if mode == "1":
        return _widen(pixels) * 255
    if mode == "L":
        return pixels
    return _widen(pixels).clamp(0, 255).to(torch.uint8)


def _cmyk_to_rgb(pixels: torch.Tensor) -> torch.Tensor:
    """Pillow's CMYK -> RGB: ``(255 - k) - round(c * (255 - k) / 255)`` per band."""
    values = pixels.to(torch.int32)
    inverse_k = 255 - values[..., 3:]
    return (inverse_k - _muldiv255(values[..., :3], inverse_k)).clamp(0, 255).to(torch.uint8)


def _palette_rgba(raw: RawImage) -> torch.Tensor:
    """(256, 4) palette with the ``transparency`` entry applied, as ``convert("RGBA")`` does."""
    palette = raw.palette
    if palette.shape[1] == 3:
        alpha = torch.full((256, 1), 255, dtype=torch.uint8, device=palette.device)
        palette = torch.cat([palette, alpha], dim=1)
    else:
        palette = palette.clone()
    transparency = raw.transparency
    if isinstance(transparency, int):
        palette[transparency, 3] = 0
    elif isinstance(transparency, bytes):
        alphas = torch.frombuffer(bytearray(transparency), dtype=torch.uint8)
        palette[: len(alphas), 3] = alphas.to(palette.device)
    elif transparency is not None:
        raise ValueError("Transparency for P mode should be bytes or int")
    return palette


def _background(bg_config: dict, height: int, width: int, device: torch.device) -> torch.Tensor:
    """The reference's background, (H, W, 1) uint8 (broadcast over the colour bands)."""
    pattern = bg_config.get("pattern", "black")
    flat = {"white": 255, "gray": 128, "black": 0}
    if pattern in flat:
        return torch.full((height, width, 1), flat[pattern], dtype=torch.uint8, device=device)
    if pattern != "chessboard":
        raise ValueError(f"Invalid background pattern: {pattern}")
    square = bg_config.get("chessboard_square_size", 16)
    white = bg_config.get("chessboard_white_value", 255)
    gray = bg_config.get("chessboard_gray_value", 200)
    gray_parity = 1 if bg_config.get("chessboard_square_on_top_left", True) else 0
    rows = torch.arange(height, device=device) // square
    cols = torch.arange(width, device=device) // square
    is_gray = (rows.unsqueeze(1) + cols.unsqueeze(0)) % 2 == gray_parity
    values = torch.where(is_gray, gray, white).to(torch.uint8)
    return values.unsqueeze(-1)
