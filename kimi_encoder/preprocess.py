"""Owner-side pixel pipeline: decode, resize, background fill, pad, normalize, patchify.

The ``cpu`` backend runs the checkpoint processor's steps with PIL, quirks
included (resize in the image's own mode, convert after the resize). The
``gpu`` backend runs the same steps as torch ops on the caller's device with
a bit-exact port of Pillow's resampler (``pil_ops``); only the file decode
stays on the host. Modes the port does not cover take the cpu backend's
steps on the host, so both backends give the same pixels in every mode:
``I;16L`` and ``RGBX`` are first re-labelled (same numbers, same Pillow
results), the rest (``YCbCr``, ``LAB``, ``HSV``, ``I;16B``, ``I;16N``,
``RGBa``, ``La``, ...) are resized and converted by PIL.
"""

from __future__ import annotations

import functools
import io
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from . import pil_ops
from .items import (
    DeferredPreprocessing,
    EncoderInputError,
    LimitExceededError,
    read_image_size,
    unsupported_backend,
)

Materialized = tuple[torch.Tensor, tuple[int, int, int]]


def decode(data: bytes, max_pixels: int | None = None) -> Image.Image:
    """Decode as is: no EXIF transpose, no mode conversion. Multi-frame files give frame 0.

    The header is read again first, as admission reads it (the format allow-list,
    ``max_pixels`` and the bomb limit, before Pillow sees the bytes); Pillow then
    opens the file only as the format its signature names and must find the
    header's size before any pixel is decoded. Pillow's decoders raise no fixed set
    of types on a broken file (``OSError``, ``SyntaxError``, ``ValueError``,
    ``EOFError``, ``struct.error``, ...): each is answered as the sender's bad file.
    """
    width, height, fmt = read_image_size(data, max_pixels)
    try:
        img = Image.open(io.BytesIO(data), formats=[fmt])
    except Image.DecompressionBombError as exc:
        raise LimitExceededError(
            f"image header claims a decompression bomb ({exc}); send a smaller image."
        ) from None
    except Exception as exc:  # noqa: BLE001 - any decoder failure is the sender's bad file
        raise EncoderInputError(
            f"cannot decode the image ({type(exc).__name__}: {exc}); send a complete, valid file."
        ) from None
    if img.size != (width, height):
        raise EncoderInputError(
            f"cannot decode the image: its {fmt} header reads {width}x{height} but the decoder "
            f"finds {img.size[0]}x{img.size[1]}; send a well-formed file."
        )
    try:
        img.load()
    except Exception as exc:  # noqa: BLE001 - any decoder failure is the sender's bad file
        raise EncoderInputError(
            f"cannot decode the image ({type(exc).__name__}: {exc}); send a complete, valid file."
        ) from None
    return img


def _has_alpha(img: Image.Image) -> bool:
    return "A" in img.getbands() or "transparency" in img.info


def _background(height: int, width: int, bg: dict) -> np.ndarray:
    pattern = bg.get("pattern", "black")
    if pattern == "chessboard":
        s = int(bg.get("chessboard_square_size", 16))
        white = float(bg.get("chessboard_white_value", 255))
        gray = float(bg.get("chessboard_gray_value", 200))
        gray_parity = 1 if bg.get("chessboard_square_on_top_left", True) else 0
        parity = (np.arange(height)[:, None] // s + np.arange(width)[None, :] // s) % 2
        plane = np.where(parity == gray_parity, gray, white).astype(np.float32)
        return np.repeat(plane[:, :, None], 3, axis=2)
    level = {"white": 255.0, "gray": 128.0, "black": 0.0}.get(pattern)
    if level is None:
        raise ValueError(f"Invalid background pattern: {pattern}")
    return np.full((height, width, 3), level, dtype=np.float32)


def to_rgb_pil(img: Image.Image, bg: dict | None) -> np.ndarray:
    """(H, W, 3) uint8: RGB passes; alpha is composited on ``bg``; the rest converts."""
    if img.mode == "RGB":
        return np.array(img)
    if bg is None or not _has_alpha(img):
        return np.array(img.convert("RGB"))
    rgba = np.asarray(img.convert("RGBA"), dtype=np.float32)
    alpha = rgba[:, :, 3:4] / np.float32(255.0)
    out = alpha * rgba[:, :, :3] + (np.float32(1.0) - alpha) * _background(*rgba.shape[:2], bg)
    return np.clip(out, 0, 255).astype(np.uint8)


def normalization_table(mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    """(3, 256) float32: the normalized value of each uint8 level per channel.

    Matches ``(x / 255.0).astype(float32)`` minus mean, times ``1/std``; a table
    makes the cpu and gpu backends agree to the last bit.
    """
    levels = (np.arange(256, dtype=np.float64) / 255.0).astype(np.float32)
    mean32 = np.asarray(mean, dtype=np.float32)[:, None]
    inv_std32 = (1.0 / np.asarray(std, dtype=np.float64)).astype(np.float32)[:, None]
    return ((levels[None, :] - mean32) * inv_std32).astype(np.float32)


@functools.lru_cache(maxsize=16)
def _device_table(
    mean: tuple[float, ...], std: tuple[float, ...], device: torch.device
) -> torch.Tensor:
    """``normalization_table`` on ``device``, computed once per (mean, std, device)."""
    return torch.from_numpy(normalization_table(mean, std)).to(device)


def _patchify(img: torch.Tensor, patch: int) -> torch.Tensor:
    """(C, H, W) -> (H/p * W/p, C, p, p), patches row-major."""
    c, h, w = img.shape
    x = img.view(c, h // patch, patch, w // patch, patch)
    return x.permute(1, 3, 0, 2, 4).reshape(-1, c, patch, patch)


def _finish(rgb: torch.Tensor, cfg: DeferredPreprocessing, patch: int) -> Materialized:
    """(h, w, 3) uint8 -> padded, normalized patches (float32) and the grid they form."""
    rc = cfg.resize_config
    h, w = rgb.shape[:2]
    if (w, h) != (rc.new_width, rc.new_height):
        raise AssertionError(f"resized to {w}x{h}, expected {rc.new_width}x{rc.new_height}")
    mean, std = tuple(map(float, cfg.image_mean)), tuple(map(float, cfg.image_std))
    table = _device_table(mean, std, rgb.device)
    padded = torch.zeros(
        (3, h + rc.pad_height, w + rc.pad_width), dtype=torch.long, device=rgb.device
    )
    padded[:, :h, :w] = rgb.permute(2, 0, 1)
    values = torch.gather(table, 1, padded.view(3, -1)).view(padded.shape)
    grid = (1, padded.shape[1] // patch, padded.shape[2] // patch)
    return _patchify(values, patch), grid


def resized_rgb_pil(img: Image.Image, cfg: DeferredPreprocessing) -> np.ndarray:
    """(h, w, 3) uint8: the processor's fill, resize and RGB conversion, in PIL."""
    rc = cfg.resize_config
    bg = cfg.transparent_bg_config
    if cfg.fill_stage == "before_resize":
        img = Image.fromarray(to_rgb_pil(img, bg))
    if img.size != (rc.new_width, rc.new_height):
        img = img.resize((rc.new_width, rc.new_height), Image.BICUBIC)
    return to_rgb_pil(img, bg)


def preprocess_cpu(img: Image.Image, cfg: DeferredPreprocessing, patch: int) -> Materialized:
    return _finish(torch.from_numpy(resized_rgb_pil(img, cfg)), cfg, patch)


def portable(img: Image.Image) -> Image.Image:
    """``img`` re-labelled into a mode ``pil_ops`` ports, where Pillow treats both alike.

    ``I;16L`` is ``I;16`` under another name. ``RGBX`` without a transparency
    entry resizes band by band and converts by dropping X, as ``RGB`` does.
    (``I;16B`` and ``I;16N`` are not relabelled: Pillow 13 resizes them with
    their bytes swapped, which only PIL itself reproduces.)
    """
    if img.mode == "I;16L":
        out = Image.frombytes("I;16", img.size, np.asarray(img).astype("<u2").tobytes())
    elif img.mode == "RGBX" and "transparency" not in img.info:
        out = Image.fromarray(np.ascontiguousarray(np.asarray(img)[..., :3]), "RGB")
    else:
        return img
    out.info.update(img.info)
    return out


@dataclass(frozen=True)
class HostImage:
    """The host's share of the ``gpu`` backend for one decoded image, as numpy arrays (so
    another process can make it): its band data in a mode ``pil_ops`` ports
    (``pil_ops.raw_arrays``; resized and converted on the device), or, for a mode only
    PIL converts, the finished ``(h, w, 3)`` uint8 RGB image (``finished``)."""

    pixels: np.ndarray
    mode: str
    palette: np.ndarray | None = None
    transparency: pil_ops.Transparency | None = None
    finished: bool = False


def host_image(img: Image.Image, cfg: DeferredPreprocessing) -> HostImage:
    """What the ``gpu`` backend computes on the host: the image relabelled into a ported
    mode as it is, or, for a mode only PIL converts, the cpu backend's resize and
    conversion."""
    img = portable(img)
    if img.mode not in pil_ops.SUPPORTED_MODES:
        return HostImage(resized_rgb_pil(img, cfg), "RGB", finished=True)
    pixels, palette = pil_ops.raw_arrays(img)
    return HostImage(pixels, img.mode, palette, img.info.get("transparency"))


def preprocess_host_image(
    host: HostImage, cfg: DeferredPreprocessing, patch: int, device: torch.device
) -> Materialized:
    """The ``gpu`` backend's torch ops on ``device``, from ``host_image``'s output."""
    if host.finished:  # PIL made it: normalized on the device
        return _finish(torch.from_numpy(host.pixels).to(device), cfg, patch)
    rc = cfg.resize_config
    bg = cfg.transparent_bg_config
    raw = pil_ops.raw_image(host.pixels, host.palette, host.mode, host.transparency, device)
    if cfg.fill_stage == "before_resize":
        raw = pil_ops.RawImage(pil_ops.to_rgb(raw, bg), "RGB", None, None)
    raw = pil_ops.resize_bicubic(raw, (rc.new_width, rc.new_height))
    return _finish(pil_ops.to_rgb(raw, bg), cfg, patch)


def preprocess_gpu(
    img: Image.Image, cfg: DeferredPreprocessing, patch: int, device: torch.device
) -> Materialized:
    return preprocess_host_image(host_image(img, cfg), cfg, patch, device)


# What ``host_stage`` hands to ``device_stage``: the cpu backend's finished patches (float32,
# on the CPU) and grid, or the gpu backend's ``HostImage``.
HostStage = Materialized | HostImage


def host_stage(data: bytes, cfg: DeferredPreprocessing, patch: int) -> HostStage:
    """Everything of one encoded image that runs on the host, in any process: its decode
    and, with the ``cpu`` backend, all of its preprocessing; with the ``gpu`` backend,
    the decoded pixels as its torch ops take them (``HostImage``)."""
    img = decode(data, cfg.max_pixels)
    if cfg.backend == "cpu":
        return preprocess_cpu(img, cfg, patch)
    if cfg.backend == "gpu":
        return host_image(img, cfg)
    raise unsupported_backend(cfg.backend)


def device_stage(
    host: HostStage, cfg: DeferredPreprocessing, patch: int, device: torch.device | str
) -> Materialized:
    """``host_stage``'s output finished on ``device``: the gpu backend's torch ops, or the
    cpu backend's patches moved there."""
    if isinstance(host, HostImage):
        return preprocess_host_image(host, cfg, patch, torch.device(device))
    pixels, grid = host
    return pixels.to(device), grid


def preprocess(
    image: bytes | Image.Image, cfg: DeferredPreprocessing, patch: int, device: torch.device
) -> Materialized:
    """One image -> (``(gh*gw, 3, p, p)`` float32 on ``device``, grid) with the item's backend."""
    img = decode(image, cfg.max_pixels) if isinstance(image, bytes) else image
    if cfg.backend == "cpu":
        pixels, grid = preprocess_cpu(img, cfg, patch)
        return pixels.to(device), grid
    if cfg.backend == "gpu":
        return preprocess_gpu(img, cfg, patch, torch.device(device))
    raise unsupported_backend(cfg.backend)
