"""Seeded inputs: photo-like images as the benchmarks send them, the same in every run."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image


def image(width: int, height: int, seed: int) -> bytes:
    """A seeded PNG photo-like image (gradients plus noise)."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    base = np.stack([xx * 255 // max(width, 1), yy * 255 // max(height, 1), (xx + yy) % 256], -1)
    noisy = np.clip(base + rng.integers(-20, 21, base.shape), 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(noisy, "RGB").save(out, "PNG")
    return out.getvalue()


def jpeg(side: int, seed: int) -> bytes:
    """A seeded square photo-like image as a JPEG (quality 90), as clients send photos."""
    out = io.BytesIO()
    Image.open(io.BytesIO(image(side, side, seed))).save(out, "JPEG", quality=90)
    return out.getvalue()


# A fixed mix for the tower: photo-like RGB of several sizes, one RGBA, one palette image.
MODE_MIX = [
    ("RGB", (640, 480)),
    ("RGB", (1024, 768)),
    ("RGB", (320, 240)),
    ("RGBA", (500, 500)),
    ("P", (400, 300)),
    ("RGB", (1920, 1080)),
    ("L", (256, 256)),
    ("RGB", (800, 200)),
]


def mode_mix(seed: int = 0) -> list[bytes]:
    """``MODE_MIX`` as seeded PNGs."""
    rng = np.random.default_rng(seed)
    out = []
    for mode, (w, h) in MODE_MIX:
        yy, xx = np.mgrid[0:h, 0:w]
        base = np.stack([xx * 255 // w, yy * 255 // h, (xx + yy) % 256, 255 - xx * 255 // w], -1)
        noisy = np.clip(base + rng.integers(-20, 21, base.shape), 0, 255).astype(np.uint8)
        img = Image.fromarray(noisy, "RGBA")
        img = img if mode == "RGBA" else img.convert("RGB")
        if mode == "P":
            img = img.quantize(64)
        elif mode == "L":
            img = img.convert("L")
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        out.append(buf.getvalue())
    return out


def photo(width: int, height: int, seed: int) -> Image.Image:
    """A seeded photo-like RGB image: smooth gradients, a hard edge, mild noise."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    fx, fy = xx / max(width - 1, 1), yy / max(height - 1, 1)
    base = np.stack([fx, fy, 0.5 + 0.5 * np.sin(6 * (fx + fy))], axis=-1)
    base[..., 1] = np.where(fx > 0.6, 1 - base[..., 1], base[..., 1])
    noise = rng.normal(0, 0.03, size=(height, width, 1)).astype(np.float32)
    return Image.fromarray(np.clip((base + noise) * 255, 0, 255).astype(np.uint8), "RGB")


def encoded(img: Image.Image, fmt: str) -> bytes:
    """``img`` as a file: JPEG at quality 90, PNG at compression level 1."""
    out = io.BytesIO()
    options = {"quality": 90} if fmt == "JPEG" else {"compress_level": 1}
    img.save(out, format=fmt, **options)
    return out.getvalue()
