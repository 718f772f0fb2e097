"""Seeded synthetic test images in every PIL mode the encoder must handle.

One generator, ``make_image``: a table of builders, one per mode or variant, over
shared seeded planes (smooth gradients, a disc and a bar with hard edges, noise;
an alpha ramp that reaches both 0 and 255). A ``-trns`` variant is its base mode
with a ``transparency`` entry taken from its own pixels.
"""

from __future__ import annotations

import functools
import io
import struct
import zlib
from collections.abc import Callable

import numpy as np
from PIL import Image

# Modes that survive a file round trip (PNG, or TIFF where PNG cannot store them).
MODES = (
    "1",
    "L",
    "LA",
    "P",
    "P-trns-index",
    "P-trns-bytes",
    "RGB",
    "RGB-trns",
    "RGBA",
    "CMYK",
    "I;16",
    "I",
    "F",
)

# Rarer modes Pillow decodes from files (TIFF, IM), and modes only built in memory.
RARE_FILE_MODES = ("YCbCr", "LAB", "I;16B")
# No accepted file format reopens these modes as themselves (TIFF reopens I;16L as I;16):
# they reach preprocessing as images in memory.
MEMORY_MODES = ("HSV", "I;16N", "I;16L", "RGBX", "RGBa", "La")
_FILE_FORMATS = {"CMYK": "TIFF", "I": "TIFF", "F": "TIFF", "YCbCr": "TIFF", "LAB": "TIFF"}
_FILE_FORMATS |= {"I;16B": "TIFF"}


def _plane(width: int, height: int, seed: int) -> np.ndarray:
    """A float image in about [0, 1]: gradients, a disc and a bar with hard edges, noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    fx, fy = x / max(width - 1, 1), y / max(height - 1, 1)
    angle = rng.uniform(0, 2 * np.pi)
    value = 0.5 + 0.35 * np.sin(4 * (fx * np.cos(angle) + fy * np.sin(angle)) + angle)
    disc = (fx - rng.uniform(0.3, 0.7)) ** 2 + (fy - rng.uniform(0.3, 0.7)) ** 2 < 0.06
    value = np.where(disc, rng.uniform(0, 0.1), value)
    value = np.where(np.abs(fx - rng.uniform(0.2, 0.8)) < 0.08, 1.0, value)
    return value + rng.normal(0, 0.06, size=value.shape)


def _palette(seed: int, entries: int, channels: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 256, entries * channels).tolist()


def _frombytes(mode: str, data: np.ndarray) -> Image.Image:
    height, width = data.shape[:2]
    return Image.frombytes(mode, (width, height), np.ascontiguousarray(data).tobytes())


class _Pixels:
    """The seeded planes of one ``size`` (width, height) and ``seed``, each made on first use."""

    def __init__(self, size: tuple[int, int], seed: int):
        self.width, self.height = size
        self.seed = seed

    @functools.cached_property
    def plane(self) -> np.ndarray:
        """(H, W) float, about [0, 1]: gray, and the 16-bit, int and float modes, come from it."""
        return _plane(self.width, self.height, self.seed)

    @functools.cached_property
    def rgb(self) -> np.ndarray:
        """(H, W, 3) uint8; its first band is ``gray``."""
        planes = [self.plane] + [_plane(self.width, self.height, self.seed + c) for c in (1, 2)]
        return np.clip(np.stack(planes, axis=-1) * 255, 0, 255).astype(np.uint8)

    @functools.cached_property
    def gray(self) -> np.ndarray:
        return np.ascontiguousarray(self.rgb[..., 0])

    @functools.cached_property
    def alpha(self) -> np.ndarray:
        """(H, W) uint8: a ramp from fully transparent to opaque, with saturated ends."""
        ramp = np.linspace(-0.2, 1.2, self.width)[None, :] * np.ones((self.height, 1))
        noisy = ramp + np.random.default_rng(self.seed + 7).normal(0, 0.05, size=ramp.shape)
        return np.clip(noisy * 255, 0, 255).astype(np.uint8)

    @functools.cached_property
    def index(self) -> np.ndarray:
        """(H, W) uint8 palette indices 0..251: the last ones lie past a 200-entry palette."""
        return (self.gray.astype(np.int32) * 251 // 255).astype(np.uint8)

    @functools.cached_property
    def uint16(self) -> np.ndarray:
        """(H, W) uint16, mostly above 255 (clamps to white), with a dark band that stays in
        range: a resize overshoots the 8 bits."""
        values = self.plane * 70000 - 2000
        values[:, : max(1, self.width // 4)] /= 200
        return np.clip(values, 0, 65535).astype(np.uint16)

    def int32(self, scale: float) -> np.ndarray:
        """(H, W) int32, negative and above 255; near the int32 limits at ``scale=2.2e9``."""
        return np.clip((self.plane - 0.3) * scale, -(2**31), 2**31 - 1).astype(np.int32)


def _paletted(px: _Pixels, channels: int = 3, with_alpha: bool = False) -> Image.Image:
    """P (or PA) over a random 200-entry RGB or RGBA palette."""
    if with_alpha:
        img = _frombytes("PA", np.stack([px.index, px.alpha], axis=-1))
    else:
        img = _frombytes("P", px.index)
    img.putpalette(_palette(px.seed, 200, channels), "RGBA" if channels == 4 else "RGB")
    return img


def _common_index(px: _Pixels) -> int:
    """The image's most frequent index within the 200-entry palette (a PNG's tRNS chunk
    covers only the palette's entries)."""
    return int(np.bincount(px.index.ravel(), minlength=256)[:200].argmax())


def _bands(mode: str, *planes: str) -> Callable[[_Pixels], Image.Image]:
    """A builder of ``mode`` from raw bytes of the named ``_Pixels`` planes."""
    return lambda px: _frombytes(mode, np.dstack([getattr(px, p) for p in planes]))


def _uint16(mode: str, dtype: str) -> Callable[[_Pixels], Image.Image]:
    return lambda px: _frombytes(mode, px.uint16.astype(dtype))


_BUILDERS: dict[str, Callable[[_Pixels], Image.Image]] = {
    "1": lambda px: Image.fromarray(px.gray > 127),
    "L": lambda px: Image.fromarray(px.gray),
    "LA": _bands("LA", "gray", "alpha"),
    "La": _bands("La", "gray", "alpha"),
    "P": _paletted,
    "P-rgba": functools.partial(_paletted, channels=4),
    "PA": functools.partial(_paletted, with_alpha=True),
    "RGB": _bands("RGB", "rgb"),
    "RGBA": _bands("RGBA", "rgb", "alpha"),
    "RGBX": _bands("RGBX", "rgb", "alpha"),
    "RGBa": _bands("RGBa", "rgb", "alpha"),
    "YCbCr": _bands("YCbCr", "rgb"),
    "LAB": _bands("LAB", "rgb"),
    "HSV": _bands("HSV", "rgb"),
    "CMYK": lambda px: _frombytes("CMYK", np.dstack([px.rgb, 255 - px.alpha])),
    "I;16": _uint16("I;16", "<u2"),
    "I;16L": _uint16("I;16L", "<u2"),
    "I;16B": _uint16("I;16B", ">u2"),
    "I;16N": _uint16("I;16N", "=u2"),
    "I": lambda px: _frombytes("I", px.int32(600)),
    "I-extreme": lambda px: _frombytes("I", px.int32(2.2e9)),
    "F": lambda px: _frombytes("F", (px.plane * 400 - 60).astype(np.float32)),
}

# Variant -> (base mode, its ``transparency`` entry).
_TRANSPARENT: dict[str, tuple[str, Callable[[_Pixels], object]]] = {
    "1-trns": ("1", lambda px: 0),
    "L-trns": ("L", lambda px: int(px.gray.flat[px.gray.size // 2])),
    "P-trns-index": ("P", _common_index),
    "P-trns-bytes": ("P", lambda px: bytes(_palette(px.seed + 1, 180, 1))),
    "P-rgba-trns-index": ("P-rgba", _common_index),
    "RGB-trns": ("RGB", lambda px: tuple(int(v) for v in px.rgb[0, 0])),
    # Pillow compares the low byte with the value clamped to 8 bits.
    "I;16-trns": ("I;16", lambda px: 0x100 + min(255, int(px.uint16[px.height // 2, 0]))),
    "I-trns": ("I", lambda px: 255),  # i2rgb clamps first: every value >= 255 matches
}


def make_image(mode: str, size: tuple[int, int], seed: int = 0) -> Image.Image:
    """A PIL image of ``size`` (width, height) in ``mode``: a PIL mode (see MODES,
    RARE_FILE_MODES, MEMORY_MODES) or a variant (``P-rgba``, ``I-extreme``, ``*-trns*``)."""
    base, transparency = _TRANSPARENT.get(mode, (mode, None))
    if base not in _BUILDERS:
        known = sorted([*_BUILDERS, *_TRANSPARENT])
        raise ValueError(f"unknown test mode {mode!r}; known: {', '.join(known)}")
    px = _Pixels(size, seed)
    img = _BUILDERS[base](px)
    if transparency is not None:
        img.info["transparency"] = transparency(px)
    return img


def encode_image(img: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    if fmt == "PNG" and img.mode in _FILE_FORMATS:
        fmt = _FILE_FORMATS[img.mode]  # PNG cannot store these modes
    img.save(buf, format=fmt)
    return buf.getvalue()


def image_bytes(mode: str, size: tuple[int, int], seed: int = 0, fmt: str = "PNG") -> bytes:
    return encode_image(make_image(mode, size, seed), fmt)


def gray_png(raw: bytes, size: tuple[int, int]) -> bytes:
    """A grayscale PNG of ``size`` (width, height) holding ``raw`` (width*height bytes)."""
    buf = io.BytesIO()
    Image.frombytes("L", size, raw).save(buf, format="PNG")
    return buf.getvalue()


def png_claiming(width: int, height: int) -> bytes:
    """A tiny PNG whose IHDR claims ``width x height`` RGB pixels (a decompression bomb's header).

    Built by hand: signature, IHDR, one small IDAT (a few zero rows) and IEND, each
    chunk with its CRC, so PIL reads the header as valid.
    """
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\0" * (1 + 3 * min(width, 64)) * 4)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def deflated_zeros(size: int, block: int = 1 << 24) -> bytes:
    """zlib stream of ``size`` zero bytes, compressed block by block (never all in memory)."""
    out, stream = [], zlib.compressobj(6)
    for start in range(0, size, block):
        out.append(stream.compress(bytes(min(block, size - start))))
    return b"".join(out) + stream.flush()


@functools.cache
def ico_bomb(side: int = 13_000) -> bytes:
    """An ICO whose one entry is a PNG of ``side x side`` zero grey pixels (~0.16 MB)."""
    ihdr = struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0)
    payload = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr)
    payload += chunk(b"IDAT", deflated_zeros(side * (side + 1))) + chunk(b"IEND", b"")
    directory = struct.pack("<HHH", 0, 1, 1) + struct.pack(
        "<BBBBHHII", 0, 0, 0, 0, 1, 8, len(payload), 22
    )
    return directory + payload


@functools.cache
def zero_png(width: int, height: int) -> bytes:
    """A ``width x height`` all-zero grey PNG, built without holding its pixels in memory."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    idat = deflated_zeros(height * (width + 1))  # a filter byte and the row, per row
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")
