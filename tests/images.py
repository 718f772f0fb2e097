"""Seeded synthetic test images in every PIL mode the encoder must handle."""

from __future__ import annotations

import functools
import io
import struct
import zlib

import numpy as np
from PIL import Image

MODES = (
    "1",
    "L",
    "LA",
    "P",
    "P+trns",
    "PA-palette",
    "RGB",
    "RGB+trns",
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


def _base(size: tuple[int, int], seed: int) -> np.ndarray:
    """(H, W, 4) float in [0, 1]: gradients, noise and hard edges."""
    w, h = size
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float64)
    planes = [
        xx / max(w - 1, 1),
        yy / max(h - 1, 1),
        0.5 + 0.5 * np.sin((xx + 2 * yy) / 5.0),
        ((xx // 7 + yy // 5) % 2).astype(np.float64),
    ]
    img = np.stack(planes, axis=-1)
    img = 0.8 * img + 0.2 * rng.random((h, w, 4))
    return np.clip(img, 0.0, 1.0)


def make_image(mode: str, size: tuple[int, int], seed: int = 0) -> Image.Image:
    """A PIL image of ``size`` (width, height) in ``mode`` (see MODES)."""
    base = _base(size, seed)
    u8 = (base * 255).round().astype(np.uint8)
    if mode == "RGB":
        return Image.fromarray(u8[..., :3], "RGB")
    if mode == "RGBA":
        return Image.fromarray(u8, "RGBA")
    if mode == "RGB+trns":
        img = Image.fromarray(u8[..., :3], "RGB")
        img.info["transparency"] = tuple(int(v) for v in u8[0, 0, :3])
        return img
    if mode == "L":
        return Image.fromarray(u8[..., 0], "L")
    if mode == "LA":
        return Image.fromarray(u8[..., [0, 3]], "LA")
    if mode == "1":
        return Image.fromarray(u8[..., 2] > 127).convert("1")
    if mode in ("P", "P+trns"):
        img = Image.fromarray(u8[..., :3], "RGB").quantize(64, method=Image.Quantize.MEDIANCUT)
        if mode == "P+trns":
            img.info["transparency"] = 3
        return img
    if mode == "PA-palette":
        img = Image.fromarray(u8[..., :3], "RGB").quantize(32, method=Image.Quantize.MEDIANCUT)
        alphas = bytes((i * 8) % 256 for i in range(256))
        img.info["transparency"] = alphas
        return img
    if mode == "CMYK":
        return Image.frombytes("CMYK", size, u8.tobytes())
    if mode == "I;16":
        arr = (base[..., 0] * 1000).astype("<u2")
        return Image.frombytes("I;16", size, arr.tobytes())
    if mode == "I":
        arr = (base[..., 1] * 600 - 100).astype(np.int32)
        return Image.frombytes("I", size, arr.astype("<i4").tobytes())
    if mode == "F":
        arr = (base[..., 2] * 300 - 20).astype(np.float32)
        return Image.frombytes("F", size, arr.astype("<f4").tobytes())
    if mode in ("YCbCr", "LAB", "HSV"):
        return Image.frombytes(mode, size, u8[..., :3].tobytes())
    if mode in ("RGBX", "RGBa"):
        return Image.frombytes(mode, size, u8.tobytes())
    if mode == "La":
        return Image.frombytes("La", size, np.ascontiguousarray(u8[..., [0, 3]]).tobytes())
    if mode in ("I;16B", "I;16L", "I;16N"):
        # Up to 1400: clamps to white above 255, and a resize overshoots the 8 bits.
        arr = (base[..., 0] * 1400).astype({"I;16B": ">u2", "I;16L": "<u2", "I;16N": "=u2"}[mode])
        return Image.frombytes(mode, size, arr.tobytes())
    raise ValueError(f"unknown test mode {mode!r}")


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
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data) & 0xFFFFFFFF
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

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
