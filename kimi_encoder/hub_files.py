"""The hub as a fetch of vision weights reads it: names, settings, and byte ranges.

``hf://REPO[@REVISION]`` names a repository and a branch, tag or commit; ``Hub`` holds how
to reach it (huggingface_hub's settings unless given). ``RangeReader`` reads byte ranges
of a commit's files through huggingface_hub's HTTP session, each checked against its
``Content-Range`` and length and resumed from the first byte not yet had when the
connection drops; ``vision_plan`` finds, from the index and each shard's safetensors
header, where the vision tensors lie, and ``write_vision_file`` copies exactly those
ranges into one vision-only safetensors file. ``kimi_encoder.hub`` puts them together
(the cache, the node's lock, the fetch). huggingface_hub's errors become ``HubError``s
that say what happened and what to do.
"""

from __future__ import annotations

import json
import logging
import os
import re
import struct
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from .config import PREPROCESSOR_FILE
from .weights import (
    INDEX_FILE,
    SINGLE_FILE,
    VISION_PREFIXES,
    CheckpointError,
    index_vision_shards,
)

log = logging.getLogger(__name__)


SCHEME = "hf://"
CONFIG_FILES = ("config.json", PREPROCESSOR_FILE)
# One read of a shard's start holds its header in every checkpoint we know (K3's: a few
# kB per shard); a longer header costs one more range.
HEADER_PROBE_BYTES = 64 << 10
# safetensors' own limit on a header.
MAX_HEADER_BYTES = 100 << 20
# A cut connection is resumed from where it stopped; this many cuts in a row without a
# byte of progress end the fetch.
MAX_STALLED_RETRIES = 5
# Asked again, as huggingface_hub's own backoff does: rate limits and server errors.
RETRY_STATUSES = (429, 500, 502, 503, 504)
# No byte for this long on a range read: the connection is taken as cut and resumed.
READ_TIMEOUT_S = 30.0
COMMIT = re.compile(r"^[0-9a-f]{40}$")
REPO = re.compile(r"^[\w.-]+/[\w.-]+$")


Progress = Callable[[int], None]  # called with each run of bytes read


class HubError(RuntimeError):
    """A hub checkpoint that cannot be had: what happened and what to do."""


@dataclass(frozen=True)
class HubRef:
    """``hf://REPO[@REVISION]``: a repository and a branch, tag or commit (default main)."""

    repo_id: str
    revision: str = "main"

    @classmethod
    def parse(cls, text: str) -> HubRef:
        """
        >>> HubRef.parse("hf://moonshotai/Kimi-K3@v1.0")
        HubRef(repo_id='moonshotai/Kimi-K3', revision='v1.0')
        >>> HubRef.parse("hf://moonshotai/Kimi-K3").revision
        'main'
        """
        if not text.startswith(SCHEME):
            raise ValueError(f"{text!r} is not a hub checkpoint; write hf://OWNER/NAME[@REVISION].")
        repo, _, revision = text[len(SCHEME) :].partition("@")
        if not REPO.match(repo) or (_ and not revision):
            raise ValueError(
                f"Hub checkpoint {text!r} is malformed; write hf://OWNER/NAME or "
                "hf://OWNER/NAME@REVISION (a branch, tag or 40-character commit), e.g. "
                "hf://moonshotai/Kimi-K3@main."
            )
        return cls(repo, revision or "main")

    def __str__(self) -> str:
        return f"{SCHEME}{self.repo_id}@{self.revision}"


def is_hub(checkpoint: object) -> bool:
    return str(checkpoint).startswith(SCHEME)


def human_bytes(n: float) -> str:
    """
    >>> human_bytes(894_000_000), human_bytes(1.5e12), human_bytes(512)
    ('0.89 GB', '1.5 TB', '512 B')
    """
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale * 0.1 and (unit != "kB" or n >= 1e3):
            value = n / scale
            return f"{value:.2g} {unit}" if value < 1 else f"{value:.3g} {unit}"
    return f"{int(n)} B"


def default_cache_dir() -> Path:
    """``$HF_HOME/kimi-encoder``: beside the hub's own cache, under its home."""
    from huggingface_hub import constants

    return Path(constants.HF_HOME) / "kimi-encoder"


@dataclass(frozen=True)
class Hub:
    """How to reach the hub: huggingface_hub's settings unless given (tests point it at a
    hub of their own)."""

    endpoint: str | None = None  # None: HF_ENDPOINT, else huggingface.co
    token: str | bool | None = None  # None: HF_TOKEN or the saved login
    offline: bool | None = None  # None: HF_HUB_OFFLINE
    cache_dir: Path | None = None  # None: default_cache_dir()
    hub_cache_dir: Path | None = None  # huggingface_hub's own cache; None: HF_HUB_CACHE

    def endpoint_url(self) -> str:
        from huggingface_hub import constants

        return self.endpoint or constants.ENDPOINT

    def is_offline(self) -> bool:
        if self.offline is not None:
            return self.offline
        from huggingface_hub import constants

        return constants.HF_HUB_OFFLINE

    def cache(self, repo_id: str) -> Path:
        from huggingface_hub.file_download import repo_folder_name

        root = Path(self.cache_dir) if self.cache_dir is not None else default_cache_dir()
        return root / repo_folder_name(repo_id=repo_id, repo_type="model")

    def url(self, ref: HubRef, commit: str, filename: str) -> str:
        from huggingface_hub import hf_hub_url

        return hf_hub_url(ref.repo_id, filename, revision=commit, endpoint=self.endpoint)

    def headers(self) -> dict[str, str]:
        from huggingface_hub.utils import build_hf_headers

        return build_hf_headers(token=self.token, library_name="kimi-encoder")


# --- what a checkpoint's hub repository holds -------------------------------------------


@dataclass(frozen=True)
class Listing:
    """A revision of a repository: its commit and its files' sizes (from one request)."""

    commit: str
    sizes: dict[str, int]


def list_files(hub: Hub, ref: HubRef, revision: str) -> Listing:
    from huggingface_hub import HfApi

    with hub_errors(hub, ref, "the repository's file list"):
        info = HfApi(endpoint=hub.endpoint, token=hub.token).model_info(
            ref.repo_id, revision=revision, files_metadata=True
        )
    sizes = {s.rfilename: int(s.size or 0) for s in info.siblings or []}
    return Listing(info.sha, sizes)


def small_file(hub: Hub, ref: HubRef, commit: str, filename: str) -> Path:
    from huggingface_hub import hf_hub_download

    with hub_errors(hub, ref, filename):
        return Path(
            hf_hub_download(
                ref.repo_id,
                filename,
                revision=commit,
                endpoint=hub.endpoint,
                token=hub.token,
                cache_dir=hub.hub_cache_dir,
                library_name="kimi-encoder",
            )
        )


@dataclass(frozen=True)
class Span:
    """One vision tensor in a shard: its header entry and absolute byte range."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


def vision_plan(
    ref: HubRef, commit: str, sizes: dict[str, int], reader: RangeReader, hub: Hub
) -> list[tuple[str, list[Span]]]:
    """[(shard, its vision tensors in file order)] from the index (or the single file)."""
    wanted = wanted_keys(ref, commit, sizes, hub)
    plan = []
    for shard in sorted(wanted):
        if shard not in sizes:
            raise HubError(
                f"{ref}'s {INDEX_FILE} names shard {shard!r}, which is not in the repository."
            )
        header, data_start = reader.header(shard)
        keys = wanted[shard] or [k for k in header if k.startswith(VISION_PREFIXES)]
        missing = sorted(k for k in keys if k not in header)
        if missing or not keys:
            listed = ": " + ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
            raise HubError(
                f"The header of {ref}'s {shard} lacks the vision tensors "
                + (f"its index lists{listed}" if missing else "a Kimi checkpoint holds")
                + "; the repository's index and shards disagree, or this is not a Kimi "
                "vision-language checkpoint."
            )
        spans = []
        for key in keys:
            entry = header[key]
            begin, end = entry["data_offsets"]
            shape = tuple(entry["shape"])
            spans.append(Span(key, entry["dtype"], shape, data_start + begin, data_start + end))
        plan.append((shard, sorted(spans, key=lambda s: s.start)))
    return plan


def wanted_keys(ref: HubRef, commit: str, sizes: dict[str, int], hub: Hub) -> dict[str, list[str]]:
    """{shard: vision keys the index lists in it}; {single file: []} without an index."""
    if INDEX_FILE in sizes:
        index = json.loads(small_file(hub, ref, commit, INDEX_FILE).read_text())
        try:
            wanted = index_vision_shards(index, f"{ref}'s {INDEX_FILE}")
        except CheckpointError as exc:
            raise HubError(str(exc)) from None
        if not wanted:
            raise HubError(
                f"{ref}'s {INDEX_FILE} lists no vision_tower.* or mm_projector.* tensor; is "
                "this a Kimi vision-language checkpoint?"
            )
        return wanted
    if SINGLE_FILE in sizes:
        return {SINGLE_FILE: []}  # every vision key its header holds
    raise HubError(
        f"{ref} (commit {commit}) has neither {INDEX_FILE} nor {SINGLE_FILE}; expected an "
        "original-format Kimi checkpoint in safetensors."
    )


def merged(spans: list[Span]) -> list[tuple[int, int]]:
    """Adjacent byte ranges merged: one request for tensors that lie back to back.

    >>> merged([Span("a", "F32", (1,), 8, 12), Span("b", "F32", (1,), 12, 16),
    ...          Span("c", "F32", (1,), 20, 24)])
    [(8, 16), (20, 24)]
    """
    out: list[tuple[int, int]] = []
    for span in spans:
        if out and out[-1][1] == span.start:
            out[-1] = (out[-1][0], span.end)
        else:
            out.append((span.start, span.end))
    return out


def write_vision_file(
    path: Path,
    plan: list[tuple[str, list[Span]]],
    reader: RangeReader,
    on_bytes: Progress | None,
    source: str,
) -> None:
    """A safetensors file of the planned tensors, laid out in the shards' order: each
    merged range is copied from the hub straight into its place."""
    header: dict[str, object] = {"__metadata__": {"format": "pt", "source": source}}
    offset = 0
    for _, spans in plan:
        for span in spans:
            size = span.end - span.start
            header[span.key] = {
                "dtype": span.dtype,
                "shape": list(span.shape),
                "data_offsets": [offset, offset + size],
            }
            offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for shard, spans in plan:
            for start, end in merged(spans):
                reader.copy(shard, start, end, f, on_bytes)
        f.flush()
        os.fsync(f.fileno())


class RangeReader:
    """Byte ranges of a commit's files through huggingface_hub's HTTP session, each
    checked against its ``Content-Range`` and length, a cut connection resumed from
    where it stopped; counts what it read."""

    def __init__(self, hub: Hub, ref: HubRef, commit: str, sizes: dict[str, int]):
        self.hub, self.ref, self.commit, self.sizes = hub, ref, commit, sizes
        self.bytes_read = 0

    def header(self, shard: str) -> tuple[dict, int]:
        """A shard's safetensors header and the offset its data starts at."""
        size = self.sizes[shard]
        head = self.read(shard, 0, min(HEADER_PROBE_BYTES, size))
        if len(head) < 8:
            raise HubError(f"{self.ref}'s {shard} is {size} bytes: too short for safetensors.")
        (length,) = struct.unpack("<Q", head[:8])
        if length > MAX_HEADER_BYTES or 8 + length > size:
            raise HubError(
                f"{self.ref}'s {shard} does not start with a safetensors header (it declares "
                f"{length} header bytes in a {size}-byte file)."
            )
        if 8 + length > len(head):
            head += self.read(shard, len(head), 8 + length)
        try:
            return json.loads(head[8 : 8 + length]), 8 + length
        except ValueError as exc:
            raise HubError(
                f"{self.ref}'s {shard} has an unreadable safetensors header: {exc}"
            ) from exc

    def read(self, shard: str, start: int, end: int) -> bytes:
        parts: list[bytes] = []
        self._stream(shard, start, end, parts.append)
        return b"".join(parts)

    def copy(self, shard: str, start: int, end: int, out, on_bytes: Progress | None) -> None:
        def write(chunk: bytes) -> None:
            out.write(chunk)
            if on_bytes is not None:
                on_bytes(len(chunk))

        self._stream(shard, start, end, write)

    def _stream(self, shard: str, start: int, end: int, sink: Callable[[bytes], None]) -> None:
        """Bytes ``[start, end)`` of ``shard`` to ``sink`` in order, each exactly once: a cut
        connection, a 429 or a 5xx is asked again from the first byte not yet had."""
        import httpx2
        from huggingface_hub.utils import get_session, hf_raise_for_status

        url = self.hub.url(self.ref, self.commit, shard)
        at, stalls = start, 0
        while at < end:
            before, why = at, ""
            headers = {
                **self.hub.headers(),
                "Range": f"bytes={at}-{end - 1}",
                "Accept-Encoding": "identity",  # the bytes as stored: ranges count them
            }
            try:
                with (
                    hub_errors(self.hub, self.ref, shard),
                    get_session().stream(
                        "GET", url, headers=headers, follow_redirects=True, timeout=READ_TIMEOUT_S
                    ) as response,
                ):
                    if response.status_code in RETRY_STATUSES:
                        why = f"HTTP {response.status_code}"
                        continue
                    if response.status_code >= 400:
                        response.read()  # the hub's error body, for its message
                        hf_raise_for_status(response)
                    self._check_range(response, shard, at, end)
                    for chunk in response.iter_raw():  # as it arrives: a cut loses nothing had
                        chunk = chunk[: end - at]
                        sink(chunk)
                        at += len(chunk)
                        self.bytes_read += len(chunk)
                        if at >= end:
                            break
            except httpx2.TransportError as exc:
                why = repr(exc)
            finally:
                if at < end:
                    stalls = 0 if at > before else stalls + 1
            if at < end:
                log.warning(
                    "%s %s: read stopped at byte %d of [%d, %d) (%s); resuming",
                    self.ref,
                    shard,
                    at,
                    start,
                    end,
                    why or "a short answer",
                )
                if stalls >= MAX_STALLED_RETRIES:
                    raise HubError(
                        f"Reading {self.ref}'s {shard} stopped at byte {at} of [{start}, {end}) "
                        f"{MAX_STALLED_RETRIES} times in a row with nothing read (last: "
                        f"{why or 'a short answer'}); check the network to the hub and run "
                        "again (nothing half-written is kept)."
                    )
                time.sleep(min(8.0, 0.25 * 2**stalls))

    def _check_range(self, response, shard: str, start: int, end: int) -> None:
        size = self.sizes.get(shard)
        got = response.headers.get("Content-Range", "")
        want = f"bytes {start}-{end - 1}/"
        whole = response.status_code == 200 and start == 0 and end == size
        if not whole and (response.status_code != 206 or not got.startswith(want)):
            raise HubError(
                f"Asked {self.ref}'s {shard} for bytes {start}-{end - 1} and got HTTP "
                f"{response.status_code} with Content-Range {got or 'missing'}; the server (or a "
                "proxy before it) does not serve byte ranges as the hub does."
            )
        total = got.rpartition("/")[2]
        if got and size is not None and total not in ("*", str(size)):
            raise HubError(
                f"{self.ref}'s {shard} is {total} bytes by its Content-Range but {size} by the "
                "repository's file list; the file changed under this commit?"
            )
        length = response.headers.get("Content-Length")
        if length is not None and int(length) != end - start:
            raise HubError(
                f"Asked {self.ref}'s {shard} for {end - start} bytes at {start}, the answer "
                f"announces {length}."
            )


@contextmanager
def hub_errors(hub: Hub, ref: HubRef, what: str) -> Iterator[None]:
    """huggingface_hub's errors as what happened and what to do."""
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        yield
    except GatedRepoError as exc:
        raise HubError(
            f"{ref} is gated and this token has no access to it (HTTP "
            f"{_status(exc)}, reading {what}): accept its terms on the hub, then set HF_TOKEN "
            "to a token of that account."
        ) from exc
    except RepositoryNotFoundError as exc:
        raise HubError(
            f"No repository {ref.repo_id!r} at {hub.endpoint_url()} (HTTP {_status(exc)}, reading "
            f"{what}): check the name and HF_ENDPOINT; if it is private or gated, set HF_TOKEN "
            "to a token with access to it."
        ) from exc
    except RevisionNotFoundError as exc:
        raise HubError(
            f"{ref.repo_id} has no revision {ref.revision!r} (HTTP 404); name an existing "
            "branch, tag or commit after '@'."
        ) from exc
    except RemoteEntryNotFoundError as exc:
        raise HubError(f"{ref} has no file {what} (HTTP 404).") from exc
    except LocalEntryNotFoundError as exc:
        raise HubError(
            f"{what} of {ref} is not in the local cache and the hub cannot be asked "
            f"({exc}); unset HF_HUB_OFFLINE or check the network to {hub.endpoint_url()}."
        ) from exc
    except HfHubHTTPError as exc:
        status = _status(exc)
        if status in (401, 403):
            raise HubError(
                f"{hub.endpoint_url()} refused {ref} (HTTP {status}, reading {what}): set "
                "HF_TOKEN to a token with read access to it."
            ) from exc
        raise HubError(f"Reading {what} of {ref} failed: {exc}") from exc


def _status(exc) -> int | None:
    response = getattr(exc, "response", None)
    return getattr(response, "status_code", None)
