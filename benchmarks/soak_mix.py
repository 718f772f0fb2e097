"""The soak's requests: unique images of many shapes, repeats, and bad inputs.

A request carries 1 to ``MAX_IMAGES`` images. Each image is new (a seeded random
size of ``SIDES`` a side, PNG, JPEG or WebP, mode RGB, RGBA, L or P where the format
holds it) or, with probability ``REPEAT``, one of the ``RECENT`` images sent last.
One request in ``BAD_EVERY`` carries one bad item among good ones and must be
answered 4xx: a truncated JPEG, a text item, an empty image or a PNG whose header
says 30000x30000 (no pixels follow).

``Checker`` holds the in-process encoder that every answer is checked against
(features of each image encoded alone; repeats looked up by digest, at most
``RECENT`` + the images of one request kept).
"""

from __future__ import annotations

import base64
import hashlib
import io
import random
import struct
import threading
import time
import zlib
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

import numpy as np
import requests
import torch
from PIL import Image

from kimi_encoder.encoder import VisionEncoder

from .bench_load import Expected, Tally, _answers, check, digest

SIDES = (16, 700)
MAX_IMAGES = 4
REPEAT = 1 / 3
RECENT = 48
BAD_EVERY = 10
FORMATS = ("PNG", "JPEG", "WEBP")
MODES = {"PNG": ("RGB", "RGBA", "L", "P"), "JPEG": ("RGB", "L"), "WEBP": ("RGB", "RGBA")}
MAX_RETRIES = 20  # of a 503 with Retry-After (backpressure), then counted lost
BAD_KINDS = ("truncated_jpeg", "text_item", "empty_image", "huge_png_header")


def picture(width: int, height: int, mode: str, fmt: str, rng: np.random.Generator) -> bytes:
    """A seeded photo-like image (gradients, noise) of ``mode`` saved as ``fmt``."""
    yy, xx = np.mgrid[0:height, 0:width]
    base = np.stack(
        [xx * 255 // width, yy * 255 // height, (xx + yy) % 256, 255 - xx * 255 // width], -1
    )
    noisy = np.clip(base + rng.integers(-24, 25, base.shape), 0, 255).astype(np.uint8)
    img = Image.fromarray(noisy, "RGBA")
    if mode == "P":
        img = img.convert("RGB").quantize(int(rng.integers(8, 256)))
    elif mode != "RGBA":
        img = img.convert(mode)
    out = io.BytesIO()
    options = {"quality": 90} if fmt in ("JPEG", "WEBP") else {"compress_level": 1}
    img.save(out, format=fmt, **options)
    return out.getvalue()


def huge_png_header(width: int = 30000, height: int = 30000) -> bytes:
    """A PNG signature and an IHDR chunk for ``width`` x ``height`` RGB, and nothing more."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    crc = zlib.crc32(b"IHDR" + ihdr) & 0xFFFFFFFF
    return b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + b"IHDR" + ihdr + struct.pack(">I", crc)


def item(data: bytes) -> dict:
    return {"type": "image", "image": base64.b64encode(data).decode("ascii")}


def bad_item(kind: str, rng: np.random.Generator) -> dict:
    if kind == "truncated_jpeg":
        whole = picture(int(rng.integers(64, 400)), int(rng.integers(64, 400)), "RGB", "JPEG", rng)
        return item(whole[: len(whole) // 2])
    if kind == "text_item":
        return {"type": "text", "text": "what is in this picture?"}
    if kind == "empty_image":
        return {"type": "image", "image": ""}
    assert kind == "huge_png_header", kind
    return item(huge_png_header())


@dataclass
class Request:
    """One request: its JSON items, and the images of the good ones (None: bad request)."""

    items: list[dict]
    images: list[bytes] | None
    bad_kind: str | None = None


class Mix:
    """A client's seeded stream of requests (one per client thread)."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.pick = random.Random(seed)
        self.recent: list[bytes] = []

    def image(self) -> bytes:
        if self.recent and self.pick.random() < REPEAT:
            return self.pick.choice(self.recent)
        fmt = self.pick.choice(FORMATS)
        mode = self.pick.choice(MODES[fmt])
        w, h = (self.pick.randint(*SIDES) for _ in range(2))
        data = picture(w, h, mode, fmt, self.rng)
        self.recent = [*self.recent, data][-RECENT:]
        return data

    def request(self) -> Request:
        images = [self.image() for _ in range(self.pick.randint(1, MAX_IMAGES))]
        items = [item(data) for data in images]
        if self.pick.randrange(BAD_EVERY) == 0:
            kind = self.pick.choice(BAD_KINDS)
            items.insert(self.pick.randrange(len(items) + 1), bad_item(kind, self.rng))
            return Request(items, None, kind)
        return Request(items, images)


class Checker:
    """Expected features of images: the in-process encoder's, one image at a time."""

    def __init__(self, checkpoint: str = "tiny", keep: int = RECENT * 8):
        torch.set_num_threads(1)
        self.encoder = VisionEncoder.from_pretrained(
            checkpoint, device="cpu", dtype="float32", backend="cpu"
        )
        self.keep = keep
        self._known: OrderedDict[str, Expected] = OrderedDict()
        self._lock = threading.Lock()

    def expected(self, data: bytes) -> Expected:
        key = hashlib.sha256(data).hexdigest()
        with self._lock:
            if key in self._known:
                self._known.move_to_end(key)
                return self._known[key]
            plan = self.encoder.plan(data)
            features = self.encoder.encode([plan])[0].numpy()
            found = Expected(list(plan.grid), features, digest(features))
            self._known[key] = found
            while len(self._known) > self.keep:
                self._known.popitem(last=False)
            return found


# --- a client ----------------------------------------------------------------------------


@dataclass
class Outcome:
    tally: Tally = field(default_factory=Tally)
    bad_4xx: Counter = field(default_factory=Counter)
    bad_not_4xx: list[str] = field(default_factory=list)
    done: list[tuple[float, float]] = field(default_factory=list)  # (answered at, latency s)


def client(url: str, mix: Mix, checker: Checker, t0: float, deadline: float) -> Outcome:
    out = Outcome()
    session = requests.Session()
    while time.monotonic() < deadline:
        req = mix.request()
        fmt = mix.pick.choice(["json", "json", "safetensors"])
        started = time.monotonic()
        for attempt in range(MAX_RETRIES + 1):
            try:
                response = session.post(
                    f"{url}/v1/encode",
                    json={"items": req.items, "response_format": fmt},
                    timeout=120,
                )
            except requests.RequestException as exc:
                out.tally.lost += 1
                out.tally.problems.append(f"lost: {type(exc).__name__}: {exc}")
                break
            retry = response.status_code == 503 and "retry-after" in response.headers
            if retry and attempt < MAX_RETRIES:
                out.tally.retried_503 += 1
                time.sleep(min(float(response.headers["retry-after"]), 2.0))
                continue
            end = time.monotonic()
            code = response.status_code
            if req.images is None:
                if 400 <= code < 500:
                    out.bad_4xx[req.bad_kind] += 1
                else:
                    out.bad_not_4xx.append(f"{req.bad_kind}: {code} {response.text[:160]}")
            elif code != 200:
                kind = "unexpected_5xx" if code >= 500 else "unexpected_4xx"
                setattr(out.tally, kind, getattr(out.tally, kind) + 1)
                out.tally.problems.append(f"{code}: {response.text[:200]}")
            elif check(
                _answers(response, fmt, len(req.images)),
                [checker.expected(data) for data in req.images],
                out.tally,
            ):
                out.tally.ok += 1
                out.tally.images += len(req.images)
                out.done.append((end - t0, end - started))
            else:
                out.tally.wrong += 1
            break
    return out
