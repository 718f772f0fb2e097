"""Helpers of the serve tests: seeded images, wire formats, HTTP calls."""

from __future__ import annotations

import base64
import io
import socket
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import requests
import torch
from PIL import Image

from deployments.args import AppArgs

# Fast teardown: no request is in flight when an app is deleted.
FAST_SHUTDOWN = {"graceful_shutdown_wait_loop_s": 0.1, "graceful_shutdown_timeout_s": 0.5}
# Limits of every test app: the 9-image request fits, the limit tests go over.
LIMITS = dict(
    max_request_bytes=4 << 20,
    max_images_per_request=10,
    max_image_pixels=1_000_000,
    max_patches_per_request=4096,
)

# (width, height, kind, seed): mixed sizes, one far larger than the rest, RGBA, palette, JPEG.
IMAGE_SPECS = [
    (64, 48, "RGB", 1),
    (700, 520, "RGB", 2),  # the big one: scaled down to the tiny preset's patch budget
    (40, 40, "RGBA", 3),
    (100, 60, "P", 4),
    (90, 45, "JPEG", 5),
    (128, 96, "RGB", 6),
    (30, 70, "RGBA", 7),
    (150, 110, "L", 8),
    (56, 56, "P", 9),
]


def app_args(
    *, rank_options: dict | None = None, ingress_options: dict | None = None, **fields
) -> AppArgs:
    """AppArgs of a test app: CPU ranks, the test limits, fast teardown, ``fields`` on top;
    ``rank_options``/``ingress_options`` override single Serve options."""
    base = AppArgs()

    def serve_options(default, extra):
        return default.model_copy(update={**FAST_SHUTDOWN, **(extra or {})})

    return AppArgs(
        **{"device": "cpu", "preprocess_backend": "cpu", **LIMITS, **fields},
        rank_options=serve_options(base.rank_options, rank_options),
        ingress_options=serve_options(base.ingress_options, ingress_options),
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def make_image(width: int, height: int, kind: str, seed: int) -> bytes:
    """Encoded file of a seeded image: smooth gradients plus noise."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    base = np.stack([xx / width, yy / height, (xx + yy) % 17 / 17, (xx // 5 + yy // 7) % 2], -1)
    pixels = (np.clip(0.8 * base + 0.2 * rng.random((height, width, 4)), 0, 1) * 255).astype(
        np.uint8
    )
    rgba = Image.fromarray(pixels, "RGBA")
    out = io.BytesIO()
    if kind == "JPEG":
        rgba.convert("RGB").save(out, "JPEG", quality=90)
    elif kind == "P":
        rgba.convert("RGB").convert("P", palette=Image.Palette.ADAPTIVE, colors=64).save(out, "PNG")
    else:
        rgba.convert(kind).save(out, "PNG")
    return out.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def decode_features(item: dict) -> np.ndarray:
    raw = base64.b64decode(item["data"])
    return np.frombuffer(raw, dtype="<f4").reshape(item["shape"])


@contextmanager
def one_thread() -> Iterator[None]:
    """Match a rank's torch thread count (num_cpus 0 -> 1 thread) for bit-exact references."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def encode(url: str, items: list[dict], **extra) -> requests.Response:
    return requests.post(f"{url}/v1/encode", json={"items": items, **extra}, timeout=120)


def rank_calls(url: str) -> list[int]:
    info = requests.get(f"{url}/v1/info", timeout=30).json()
    return [r["calls"] for r in info["ranks"]]
