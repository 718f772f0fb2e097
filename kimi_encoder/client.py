"""``EncoderClient``: send images to a running encode server (``client_files`` runs directories).

Pure standard library plus numpy and safetensors (no ray, no requests): the
client runs wherever Python does. ``EncoderClient.encode`` sends one request
and retries what a server under load or restart answers (408, 429, 5xx,
connection errors) with exponential backoff, honouring ``Retry-After``.
Against a running server (``make serve``; an example, not a doctest)::

    client = EncoderClient("http://127.0.0.1:8000")
    [out] = client.encode([open("cat.png", "rb").read()])
    out.features.shape, out.grid_thw, out.owner_rank
    # ((12, 7168), (1, 6, 8), 0)
"""

from __future__ import annotations

import json
import random
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import Any

import numpy as np

from . import b64
from .features import read_safetensors, to_float32

RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp", ".tif", ".tiff"})
_ITEM = re.compile(r"^item (\d+):")
# Statuses that blame the request's content (an image), not the request or the server:
# invalid (400), over a limit (413), a format the server does not read (415).
ITEM_STATUSES = (400, 413, 415)


@dataclass(frozen=True)
class Encoded:
    """One image's features as the server returned them: ``raw`` in the wire ``dtype``
    (bfloat16 as uint16 words, ``kimi_encoder.features``), ``features`` their float32
    values (widened exactly)."""

    raw: np.ndarray  # (num_tokens, text_hidden_size)
    dtype: str
    grid_thw: tuple[int, int, int]
    owner_rank: int

    @property
    def features(self) -> np.ndarray:
        return to_float32(self.raw, self.dtype)


class EncodeError(Exception):
    """The server refused a request (or kept failing): its status, error type and message."""

    def __init__(self, status: int | None, kind: str, message: str):
        super().__init__(f"{status or 'no response'} {kind}: {message}")
        self.status = status
        self.kind = kind
        self.message = message

    @property
    def item(self) -> int | None:
        """Index of the image the error names (``item N: ...``), if any."""
        match = _ITEM.match(self.message)
        return int(match.group(1)) if match else None


class EncoderClient:
    """HTTP client of ``POST /v1/encode`` (safetensors responses) with retries."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 300.0,
        max_retries: int = 6,
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        backend: str | None = None,
        feature_dtype: str | None = None,
        api_key: str | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ):
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.backend = backend
        self.feature_dtype = feature_dtype
        self.api_key = api_key
        self.sleep = sleep
        self.model: str | None = None
        self.retries = 0  # retried attempts over this client's life (all threads)
        self._lock = threading.Lock()

    def encode(self, images: Sequence[bytes]) -> list[Encoded]:
        """Features of ``images`` (encoded files), in order. Raises ``EncodeError``."""
        body: dict[str, Any] = {
            "items": [{"type": "image", "image": b64.encode(b).decode()} for b in images],
            "response_format": "safetensors",
        }
        if self.backend:
            body["backend"] = self.backend
        if self.feature_dtype:
            body["feature_dtype"] = self.feature_dtype
        blob = self._post("/v1/encode", json.dumps(body).encode())
        tensors, meta = read_safetensors(blob)
        self.model = meta.get("model", self.model)
        owners = json.loads(meta["owner_ranks"])
        if len(owners) != len(images):
            raise EncodeError(200, "bad_response", f"{len(owners)} results for {len(images)}")
        return [
            Encoded(
                *tensors[f"features.{i}"],
                tuple(int(v) for v in tensors[f"grid_thw.{i}"][0][0]),  # type: ignore[arg-type]
                int(owners[i]),
            )
            for i in range(len(images))
        ]

    def info(self) -> dict[str, Any]:
        """``GET /v1/info``: model, dims and each rank's state."""
        return json.loads(self._request(urllib.request.Request(self.url + "/v1/info")))

    def _post(self, path: str, data: bytes) -> bytes:
        headers = {"Content-Type": "application/json"}
        return self._request(urllib.request.Request(self.url + path, data, headers))

    def _request(self, request: urllib.request.Request) -> bytes:
        if self.api_key:
            request.add_header("Authorization", f"Bearer {self.api_key}")
        for attempt in range(self.max_retries + 1):
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    return response.read()
            except urllib.error.HTTPError as exc:
                error = _http_error(exc)
                if exc.code not in RETRY_STATUSES or attempt == self.max_retries:
                    raise error from None
                delay = _retry_after(exc.headers.get("Retry-After"))
            except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
                if attempt == self.max_retries:
                    reason = getattr(exc, "reason", exc)
                    raise EncodeError(None, "connection_error", f"{self.url}: {reason}") from None
                delay = None
            with self._lock:
                self.retries += 1
            backoff = min(self.max_backoff_s, self.backoff_s * 2**attempt)
            self.sleep(delay if delay is not None else backoff * random.uniform(0.5, 1.0))
        raise AssertionError("unreachable: the last attempt returns or raises")


def _http_error(exc: urllib.error.HTTPError) -> EncodeError:
    raw = exc.read()
    try:
        error = json.loads(raw)["error"]
        return EncodeError(exc.code, str(error["type"]), str(error["message"]))
    except (ValueError, KeyError, TypeError):
        return EncodeError(exc.code, "http_error", raw[:300].decode("utf-8", "replace"))


def _retry_after(value: str | None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (seconds or an HTTP date)."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        try:
            return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
        except (TypeError, ValueError):
            return None
