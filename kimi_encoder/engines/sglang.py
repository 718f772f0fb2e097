"""sglang's encode/prefill split, as its 0.5.23 release speaks it.

sglang's prefill (``--language-only``) posts ``/encode`` for each part of a
request's images and, in ``zmq_to_scheduler`` mode, each of its scheduler ranks
posts ``/scheduler_receive_url`` with the ZMQ address it listens on. The
encoder answers by pushing two frames per part to the prefill: frame 0, a
pickle of sglang's ``EmbeddingData`` without the embedding; frame 1, the
embedding's raw bytes. Everything version-bound lives at the top of this file;
``docs/epd.md`` cites the sglang source for each fact.
The frames themselves are built in ``sglang_frames.py``.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from ..features import FEATURE_DTYPES, torch_dtype
from ..items import EncoderInputError, check_modality
from .media import FetchPolicy, read_image_ref
from .transport import Frame, PushError, ReceivePolicy, ZmqPusher, split_address

SGLANG_VERSION = "0.5.23"

# The classes frame 0 names, at their 0.5.23 module paths (both on the allow-list).
EMBEDDING_DATA = ("sglang.srt.disaggregation.encoder.receiver", "EmbeddingData")
MODALITY = ("sglang.srt.multimodal.modality", "Modality")
MODALITY_IMAGE = 1  # Modality.IMAGE = auto()
PART_SUFFIX = "_local_part_"  # part req_id = f"{rid}{PART_SUFFIX}{part_idx}"

ENCODE_REQUIRED = ("req_id", "modality", "mm_items", "num_parts", "part_idx")
ENCODE_OPTIONAL = (
    "encoder_idx",
    "encoder_url",
    "prefill_host",
    "embedding_port",
    "time_stats_json",
)
RECEIVE_URL_FIELDS = ("req_id", "receive_count", "receive_url", "modality")
ITEM_KEYS = ("url", "content_hash")
# Per-image options sglang forwards and its own Kimi-K3 encoder does not apply either.
IGNORED_ITEM_KEYS = ("detail", "max_dynamic_patch", "max_long_side_pixel", "preprocess_kwargs")
CONTENT_HASH_PREFIX = "sha256:"

TORCH_DTYPES = tuple(torch_dtype(name) for name in FEATURE_DTYPES)
# Globals frame 0 may contain: our two classes, the feature dtypes, and the
# int64 tensor type that rebuilds the grid from its rows. All are on 0.5.23's
# allow-list (``SafeUnpickler.ALLOWED_GLOBALS``).
FRAME0_GLOBALS = frozenset(
    {
        EMBEDDING_DATA,
        MODALITY,
        *(("torch", name) for name in FEATURE_DTYPES),
        ("torch", "LongTensor"),
    }
)


class ReceiveTimeout(TimeoutError):
    """The prefill's scheduler ranks did not all say where to send in time."""


class RegistryFull(RuntimeError):
    """Too many requests wait for receive addresses at once (answer 503)."""


@dataclass(frozen=True)
class MediaItem:
    """One image of an ``/encode`` part: a reference and an optional content digest."""

    url: str
    content_hash: str | None = None

    @classmethod
    def from_json(cls, value: Any, index: int) -> MediaItem:
        if isinstance(value, str):
            return cls(value)
        if not isinstance(value, dict) or not isinstance(value.get("url"), str):
            raise EncoderInputError(
                f"mm_items entry must be a URL string or an object with a string 'url', "
                f"got {_short(value)}.",
                index,
            )
        unknown = sorted(set(value) - set(ITEM_KEYS) - set(IGNORED_ITEM_KEYS))
        if unknown:
            raise EncoderInputError(
                f"mm_items entry has keys {unknown} this encoder does not know; allowed: "
                f"{list(ITEM_KEYS)} (ignored: {list(IGNORED_ITEM_KEYS)}). Remove them.",
                index,
            )
        content_hash = value.get("content_hash")
        if content_hash is not None and not _is_sha256(content_hash):
            raise EncoderInputError(
                f"content_hash must be 'sha256:' and 64 hex digits, got {_short(content_hash)}.",
                index,
            )
        return cls(value["url"], content_hash.lower() if content_hash else None)


@dataclass(frozen=True)
class EncodeRequest:
    """``POST /encode``: one part of one prefill request's images."""

    req_id: str  # the part's id: f"{rid}{PART_SUFFIX}{part_idx}"
    modality: str
    mm_items: tuple[MediaItem, ...]
    num_parts: int
    part_idx: int
    encoder_idx: int | None = None
    encoder_url: str | None = None
    prefill_host: str | None = None
    # Set in zmq_to_tokenizer mode (push there); None in zmq_to_scheduler mode.
    embedding_port: int | None = None
    time_stats_json: dict | None = None

    @classmethod
    def from_json(cls, body: Any) -> EncodeRequest:
        fields = _check_fields(body, "/encode", ENCODE_REQUIRED, ENCODE_OPTIONAL)
        check_modality(str(fields["modality"]).lower())
        num_parts = _int(fields, "num_parts", "/encode", minimum=1)
        part_idx = _int(fields, "part_idx", "/encode", minimum=0)
        if part_idx >= num_parts:
            raise EncoderInputError(
                f"/encode part_idx {part_idx} is not below num_parts {num_parts}."
            )
        items = fields["mm_items"]
        if not isinstance(items, list) or not items:
            raise EncoderInputError(
                f"/encode mm_items must be a non-empty list, got {_short(items)}."
            )
        port = _int(fields, "embedding_port", "/encode", minimum=1, optional=True)
        host = _str(fields, "prefill_host", "/encode", optional=True)
        if port is not None and not host:
            raise EncoderInputError(
                f"/encode has embedding_port {port} but no prefill_host to send to; "
                "send both (zmq_to_tokenizer) or neither (zmq_to_scheduler)."
            )
        stats = fields.get("time_stats_json")
        if stats is not None and not isinstance(stats, dict):
            raise EncoderInputError(
                f"/encode time_stats_json must be an object or null, got {_short(stats)}."
            )
        return cls(
            req_id=_str(fields, "req_id", "/encode"),
            modality=fields["modality"],
            mm_items=tuple(MediaItem.from_json(v, i) for i, v in enumerate(items)),
            num_parts=num_parts,
            part_idx=part_idx,
            encoder_idx=_int(fields, "encoder_idx", "/encode", minimum=0, optional=True),
            encoder_url=_str(fields, "encoder_url", "/encode", optional=True),
            prefill_host=host,
            embedding_port=port,
            time_stats_json=stats,
        )

    @property
    def rid(self) -> str:
        """The prefill's request id, as its receiver recovers it from ``req_id``."""
        return self.req_id.rpartition(PART_SUFFIX)[0] if PART_SUFFIX in self.req_id else self.req_id

    @property
    def receive_address(self) -> str | None:
        """``host:port`` (``[v6]:port``) to push to in zmq_to_tokenizer mode, else None."""
        if self.embedding_port is None:
            return None
        host = self.prefill_host
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"{host}:{self.embedding_port}"


@dataclass(frozen=True)
class ReceiveUrlRequest:
    """``POST /scheduler_receive_url``: one scheduler rank's address for one part."""

    req_id: str
    receive_count: int  # how many addresses (TP ranks) the part goes to
    receive_url: str  # host:port
    modality: str

    @classmethod
    def from_json(cls, body: Any) -> ReceiveUrlRequest:
        where = "/scheduler_receive_url"
        fields = _check_fields(body, where, RECEIVE_URL_FIELDS, ())
        check_modality(str(fields["modality"]).lower())
        url = _str(fields, "receive_url", where)
        try:
            split_address(url)
        except ValueError as exc:
            raise EncoderInputError(f"{where} {exc}") from None
        return cls(
            req_id=_str(fields, "req_id", where),
            receive_count=_int(fields, "receive_count", where, minimum=1),
            receive_url=url,
            modality=fields["modality"],
        )


def error_target(body: Any) -> EncodeRequest | None:
    """Where the error frame of a refused ``/encode`` body goes, or None if nowhere.

    ``EncodeRequest.from_json`` refuses a whole body for one bad field (another
    modality, an unknown key, a bad item); the prefill still waits for that part.
    The result names the part (``req_id``, ``num_parts``, ``part_idx``) and its
    receive address when those fields are valid, and has no items.
    """
    if not isinstance(body, dict):
        return None
    where = "/encode"
    try:
        req_id = _str(body, "req_id", where)
        num_parts = _int(body, "num_parts", where, minimum=1)
        part_idx = _int(body, "part_idx", where, minimum=0)
        port = _int(body, "embedding_port", where, minimum=1, optional=True)
        host = _str(body, "prefill_host", where, optional=True)
    except EncoderInputError:
        return None
    if part_idx >= num_parts or (port is not None and host is None):
        return None
    modality = body.get("modality")
    return EncodeRequest(
        req_id=req_id,
        modality=modality if isinstance(modality, str) else "IMAGE",
        mm_items=(),
        num_parts=num_parts,
        part_idx=part_idx,
        prefill_host=host,
        embedding_port=port,
    )


class PartImage(NamedTuple):
    """One image of a part: its encoded bytes, and their SHA-256 when the part sent a
    ``content_hash`` (checked against them), for the item to reuse as its digest."""

    data: bytes
    sha256: bytes | None = None


def load_images(req: EncodeRequest, policy: FetchPolicy) -> list[PartImage]:
    """The encoded images of one part, in item order; checks each content_hash.

    Blocks while fetching URLs: call it through ``asyncio.to_thread`` from a loop.
    """
    images = []
    for index, item in enumerate(req.mm_items):
        data = read_image_ref(item.url, policy, index)
        sha256 = None
        if item.content_hash is not None:
            sha256 = hashlib.sha256(data).digest()
            digest = CONTENT_HASH_PREFIX + sha256.hex()
            if digest != item.content_hash:
                raise EncoderInputError(
                    f"content_hash {item.content_hash} does not match the image's bytes "
                    f"({digest}); send the hash of exactly these bytes, or none.",
                    index,
                )
        images.append(PartImage(data, sha256))
    return images


def error_body(req_id: str | None, message: str) -> dict:
    """JSON body of a non-200 answer; sglang's receiver reports its ``message``."""
    return {"status": "error", "message": message, "req_id": req_id}


@dataclass
class _Pending:
    count: int | None = None
    addresses: dict[str, None] = field(default_factory=dict)  # an ordered set
    created: float = field(default_factory=time.monotonic)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    waiting: bool = False


@dataclass
class ReceiverRegistry:
    """Part id -> the addresses its frames go to (zmq_to_scheduler); use from one loop.

    A rank may register before or after its part's ``/encode`` arrives. An entry
    is forgotten once its part was sent (or gave up), and entries nobody waited
    for expire after ``ttl_s``.
    """

    ttl_s: float = 180.0
    max_entries: int = 4096
    _entries: dict[str, _Pending] = field(default_factory=dict, init=False, repr=False)

    def register(self, req: ReceiveUrlRequest) -> None:
        entry = self._entry(req.req_id)
        if entry.count is None:
            entry.count = req.receive_count
        elif entry.count != req.receive_count:
            raise EncoderInputError(
                f"receive_count for {req.req_id!r} was {entry.count}, now "
                f"{req.receive_count}; every scheduler rank of one prefill sends its TP size."
            )
        entry.addresses[req.receive_url] = None
        if len(entry.addresses) >= entry.count:
            entry.ready.set()

    async def wait_for(self, req_id: str, timeout_s: float) -> list[str]:
        """Every registered ``host:port`` for ``req_id``, once all have come."""
        entry = self._entry(req_id)
        entry.waiting = True
        try:
            await asyncio.wait_for(entry.ready.wait(), timeout_s)
        except asyncio.TimeoutError:
            raise ReceiveTimeout(
                f"{len(entry.addresses)} of {entry.count or 'an unknown number of'} receive "
                f"addresses for {req_id!r} came within {timeout_s} s; the prefill's scheduler "
                "ranks did not post /scheduler_receive_url for this part."
            ) from None
        finally:
            if self._entries.get(req_id) is entry:
                del self._entries[req_id]
        return list(entry.addresses)

    def __len__(self) -> int:
        return len(self._entries)

    def _entry(self, req_id: str) -> _Pending:
        entry = self._entries.get(req_id)
        if entry is not None:
            return entry
        now = time.monotonic()
        for key, old in list(self._entries.items()):
            if not old.waiting and now - old.created >= self.ttl_s:
                del self._entries[key]
        if len(self._entries) >= self.max_entries:
            raise RegistryFull(
                f"{len(self._entries)} parts already wait for receive addresses (max_entries="
                f"{self.max_entries}); retry later."
            )
        entry = self._entries[req_id] = _Pending(created=now)
        return entry


class Receivers(Protocol):
    """Where zmq_to_scheduler parts go: a ``ReceiverRegistry``, or a registry that
    several processes share (a service with several HTTP front ends)."""

    async def wait_for(self, req_id: str, timeout_s: float) -> list[str]: ...


async def receive_endpoints(
    req: EncodeRequest, policy: ReceivePolicy, registry: Receivers, *, wait_s: float
) -> list[str]:
    """The ``tcp://ip:port`` endpoints one part's frames go to, each checked by ``policy``.

    zmq_to_tokenizer: the request's own ``prefill_host:embedding_port``, resolved once.
    zmq_to_scheduler: every address the scheduler ranks registered for the part, waiting
    up to ``wait_s`` for them (a service registers each as the IP it checked, so that
    check is repeated here without a lookup). Raises ``ReceiveAddressRefused`` before
    anything connects to an address outside the policy's networks.
    """
    if req.receive_address is not None:
        return [(await policy.check_async(req.receive_address)).endpoint]
    addresses = await registry.wait_for(req.req_id, wait_s)
    return [(await policy.check_async(address)).endpoint for address in addresses]


async def push_frames(
    frames: Sequence[Frame], endpoints: Sequence[str], pusher: ZmqPusher, *, reuse: bool
) -> None:
    """Push one part's frames to each of ``endpoints`` (from ``receive_endpoints``).

    ``reuse=False`` for a zmq_to_tokenizer port, opened for one request alone.
    """
    if len(endpoints) == 1:
        await pusher.send(endpoints[0], frames, reuse=reuse)
        return
    results = await asyncio.gather(
        *(pusher.send(e, frames, reuse=reuse) for e in endpoints), return_exceptions=True
    )
    failures = [r for r in results if isinstance(r, BaseException)]
    if failures:
        raise PushError(f"{len(failures)} of {len(endpoints)} sends failed: {failures[0]}")


async def deliver(
    req: EncodeRequest,
    frames: Sequence[Frame],
    pusher: ZmqPusher,
    registry: Receivers,
    *,
    wait_s: float,
    policy: ReceivePolicy | None = None,
) -> list[str]:
    """Push one part's frames where its prefill listens; returns the endpoints.

    ``receive_endpoints`` under ``policy`` (default: loopback and the private
    networks), then ``push_frames``.
    """
    endpoints = await receive_endpoints(req, policy or ReceivePolicy(), registry, wait_s=wait_s)
    await push_frames(frames, endpoints, pusher, reuse=req.receive_address is None)
    return endpoints


def _check_fields(body: Any, where: str, required: tuple, optional: tuple) -> dict:
    if not isinstance(body, dict):
        raise EncoderInputError(f"{where} body must be a JSON object, got {_short(body)}.")
    missing = [k for k in required if k not in body]
    unknown = sorted(set(body) - set(required) - set(optional))
    if missing or unknown:
        raise EncoderInputError(
            f"{where} body has missing fields {missing} and unknown fields {unknown}; "
            f"sglang {SGLANG_VERSION} sends {list(required + optional)}."
        )
    return body


def _int(fields: dict, key: str, where: str, *, minimum: int, optional: bool = False):
    value = fields.get(key)
    if value is None and optional:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise EncoderInputError(
            f"{where} field {key!r} must be an integer >= {minimum}"
            f"{' or null' if optional else ''}, got {_short(value)}."
        )
    return value


def _str(fields: dict, key: str, where: str, *, optional: bool = False):
    value = fields.get(key)
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value:
        raise EncoderInputError(
            f"{where} field {key!r} must be a non-empty string"
            f"{' or null' if optional else ''}, got {_short(value)}."
        )
    return value


def _is_sha256(value: Any) -> bool:
    if not isinstance(value, str) or not value.startswith(CONTENT_HASH_PREFIX):
        return False
    digest = value[len(CONTENT_HASH_PREFIX) :]
    return len(digest) == 64 and all(c in "0123456789abcdefABCDEF" for c in digest)


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
