"""Checkpoints named on the Hugging Face hub, ``hf://REPO[@REVISION]``: vision bytes only.

A rank needs the vision tower and projector: a few hundred MB of a repository that holds
the language model too (Kimi-K3: about 0.9 GB of 1.5 TB in 96 shards). A safetensors file
opens with a header that says where each tensor's bytes lie, and the hub serves byte
ranges, so a fetch reads, for each shard the index lists for ``vision_tower.*`` /
``mm_projector.*``, its header and exactly those tensors' byte ranges (adjacent ones
merged), never the rest of the shard. The result is a small local checkpoint directory
(the config files and one vision-only ``model.safetensors``) that ``weights.load_model``
reads like any other.

``huggingface_hub`` does everything it already does: the endpoint (``HF_ENDPOINT``), the
token (``HF_TOKEN``, gated repositories), offline mode (``HF_HUB_OFFLINE``), revision to
commit, its HTTP session (retries, redirects to the storage host), the small files (Xet
included) and progress bars. Written here: the header-guided range reads, their resume
and checks, and the vision-only file they make.

The cache: ``$HF_HOME/kimi-encoder/models--OWNER--NAME/``, ``snapshots/COMMIT/`` (one
complete checkpoint per commit, renamed into place once whole, so a killed fetch never
leaves one that looks whole) and ``refs/REVISION`` (its commit, for offline starts). The
first process on a node fetches under a file lock; the others wait for it and read its
result. A start that finds the commit's snapshot makes no request (a branch or tag costs
one metadata request to learn its commit; none offline).
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import shutil
import struct
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
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
RECORD_FILE = "kimi-encoder-fetch.json"
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


@dataclass
class Fetched:
    """Where a rank's weights came from: what ``/v1/info`` shows for each rank."""

    path: str
    repo: str
    revision: str
    commit: str
    bytes_read: int  # bytes the fetch took from the hub: headers and vision ranges
    vision_bytes: int  # the vision tensors' bytes
    repo_shard_bytes: int  # every shard of the repository, whole
    shards: int  # shards in the repository
    shards_read: int  # shards with vision tensors: the only ones touched
    seconds: float  # the fetch's wall time
    cached: bool = False  # this start found the fetch done (by this or another process)
    extra: dict = field(default_factory=dict)

    def summary(self) -> str:
        """One line: 'read 0.89 GB of 1.5 TB in 96 shards ...'."""
        how = "found in the cache" if self.cached else f"in {self.seconds:.1f} s"
        return (
            f"hf://{self.repo}@{self.commit[:12]}: read {human_bytes(self.bytes_read)} of "
            f"{human_bytes(self.repo_shard_bytes)} in {self.shards} shards "
            f"({self.shards_read} with vision tensors) {how}"
        )

    def info(self) -> dict:
        out = asdict(self)
        out.pop("extra")
        out["source"] = f"hf://{self.repo}"
        out["seconds"] = round(self.seconds, 3)
        return out


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


def _listing(hub: Hub, ref: HubRef, revision: str) -> Listing:
    from huggingface_hub import HfApi

    with _hub_errors(ref, "the repository's file list"):
        info = HfApi(endpoint=hub.endpoint, token=hub.token).model_info(
            ref.repo_id, revision=revision, files_metadata=True
        )
    sizes = {s.rfilename: int(s.size or 0) for s in info.siblings or []}
    return Listing(info.sha, sizes)


def resolve_commit(ref: HubRef, hub: Hub) -> tuple[str, Listing | None]:
    """The commit ``ref`` names, and the listing when it took a request to learn it: none
    for a commit; for a branch or tag one metadata request, or offline the commit cached
    for it (``refs/REVISION``)."""
    if COMMIT.match(ref.revision):
        return ref.revision, None
    refs = hub.cache(ref.repo_id) / "refs" / ref.revision
    if hub.is_offline():
        if refs.is_file():
            return refs.read_text().strip(), None
        raise HubError(
            f"HF_HUB_OFFLINE is set and no fetch of {ref} is cached in "
            f"{hub.cache(ref.repo_id)}: run `kimi-encoder fetch {ref}` where the hub can be "
            "reached (with the same HF_HOME, or copy that folder here), or unset "
            "HF_HUB_OFFLINE."
        )
    listing = _listing(hub, ref, ref.revision)
    refs.parent.mkdir(parents=True, exist_ok=True)
    _write_atomic(refs, listing.commit)
    return listing.commit, listing


def cached_path(checkpoint: str, hub: Hub | None = None) -> Path | None:
    """The fetched snapshot of ``checkpoint`` on this machine, without a request (a branch
    or tag through the commit cached for it); None when there is none."""
    hub = hub or Hub()
    ref = HubRef.parse(checkpoint)
    commit = ref.revision
    if not COMMIT.match(commit):
        refs = hub.cache(ref.repo_id) / "refs" / ref.revision
        if not refs.is_file():
            return None
        commit = refs.read_text().strip()
    snapshot = hub.cache(ref.repo_id) / "snapshots" / commit
    return snapshot if (snapshot / RECORD_FILE).is_file() else None


def config_dir(ref: HubRef, hub: Hub | None = None) -> Path:
    """A directory with the checkpoint's ``config.json`` and processor config, for the
    ingress, which needs no weights: the fetched snapshot when this node has it (no
    request for a commit), else the two files through huggingface_hub's own cache."""
    hub = hub or Hub()
    commit, _ = resolve_commit(ref, hub)
    snapshot = hub.cache(ref.repo_id) / "snapshots" / commit
    if (snapshot / RECORD_FILE).is_file():
        return snapshot
    if hub.is_offline():
        raise _offline_error(ref, commit, hub)
    paths = [_small_file(hub, ref, commit, name) for name in CONFIG_FILES]
    return paths[0].parent


def _small_file(hub: Hub, ref: HubRef, commit: str, filename: str) -> Path:
    from huggingface_hub import hf_hub_download

    with _hub_errors(ref, filename):
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


# --- the fetch ------------------------------------------------------------------------


Progress = Callable[[int], None]  # called with each run of bytes read


def fetch(
    ref: HubRef,
    hub: Hub | None = None,
    *,
    to: str | Path | None = None,
    progress: Callable[[int], Progress] | None = None,
) -> Fetched:
    """The vision-only checkpoint of ``ref``, fetched once per node and commit.

    ``to``: the directory to write (default: the cache's ``snapshots/COMMIT``). Its
    sibling ``.NAME.lock`` serializes processes: one fetches, the others wait and read
    its result. ``progress(total_bytes)`` returns a callback of each run of bytes read.
    """
    hub = hub or Hub()
    started = time.perf_counter()
    commit, listing = resolve_commit(ref, hub)
    target = Path(to) if to is not None else hub.cache(ref.repo_id) / "snapshots" / commit
    found = _found(target, ref, commit)
    if found is not None:
        return found
    if hub.is_offline():
        raise _offline_error(ref, commit, hub)
    with _node_lock(target) as waited_s:
        found = _found(target, ref, commit)
        if found is not None:
            log.info("%s: fetched by another process (waited %.1f s)", ref, waited_s)
            return found
        if listing is None or listing.commit != commit:
            listing = _listing(hub, ref, commit)
        fetched = _fetch_into(target, ref, hub, listing, progress)
    fetched.seconds = time.perf_counter() - started
    _write_atomic(target / RECORD_FILE, json.dumps(fetched.info(), indent=1))
    return fetched


def _found(target: Path, ref: HubRef, commit: str) -> Fetched | None:
    record = target / RECORD_FILE
    if not record.is_file():
        return None
    data = json.loads(record.read_text())
    if data.get("commit") != commit or data.get("repo") != ref.repo_id:
        raise HubError(
            f"{target} holds a fetch of hf://{data.get('repo')}@{data.get('commit')}, not of "
            f"{ref} ({commit}); fetch to another directory."
        )
    data.pop("source", None)
    return Fetched(**{**data, "path": str(target), "revision": ref.revision, "cached": True})


def _offline_error(ref: HubRef, commit: str, hub: Hub) -> HubError:
    return HubError(
        f"HF_HUB_OFFLINE is set and {ref} (commit {commit}) has not been fetched into "
        f"{hub.cache(ref.repo_id)}: run `kimi-encoder fetch {ref}` where the hub can be "
        "reached (with the same HF_HOME, or copy that folder here), or unset HF_HUB_OFFLINE."
    )


@contextmanager
def _node_lock(target: Path) -> Iterator[float]:
    """An exclusive lock on ``.TARGET.lock`` beside ``target``; yields seconds waited."""
    target.parent.mkdir(parents=True, exist_ok=True)
    path = target.parent / f".{target.name}.lock"
    started = time.perf_counter()
    with path.open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process's fetch into %s", target)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield time.perf_counter() - started
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _fetch_into(
    target: Path,
    ref: HubRef,
    hub: Hub,
    listing: Listing,
    progress: Callable[[int], Progress] | None,
) -> Fetched:
    """Fetch into a temporary sibling of ``target`` and rename it into place when whole;
    on any failure nothing is left behind. Called under the node lock."""
    for stale in target.parent.glob(f".{target.name}.tmp-*"):  # a killed fetch's
        shutil.rmtree(stale, ignore_errors=True)
    if target.exists():
        raise HubError(
            f"{target} exists but holds no finished fetch ({RECORD_FILE} is missing); "
            "remove it or fetch to another directory."
        )
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
    tmp.mkdir()
    try:
        fetched = _write_checkpoint(tmp, ref, hub, listing, progress)
        os.replace(tmp, target)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
            raise HubError(
                f"No room to write {ref}'s vision weights under {target.parent}: {exc.strerror} "
                "(nothing half-written is left). Free space there, or point HF_HOME (or "
                "`kimi-encoder fetch --to DIR`) at a disk with room for them."
            ) from exc
        raise
    fetched.path = str(target)
    return fetched


def _write_checkpoint(
    out: Path,
    ref: HubRef,
    hub: Hub,
    listing: Listing,
    progress: Callable[[int], Progress] | None,
) -> Fetched:
    """The config files and one vision-only ``model.safetensors`` in ``out``."""
    commit, sizes = listing.commit, listing.sizes
    for name in CONFIG_FILES:
        if name not in sizes:
            raise HubError(
                f"{ref} (commit {commit}) has no {name}; expected an original-format Kimi-K3 or "
                "K2.5 checkpoint repository."
            )
        shutil.copyfile(_small_file(hub, ref, commit, name), out / name)
    shards = sorted(name for name in sizes if name.endswith(".safetensors"))
    reader = RangeReader(hub, ref, commit, sizes)
    plan = _vision_plan(ref, commit, sizes, reader, hub)
    total = sum(end - start for _, spans in plan for start, end in _merged(spans))
    _check_room(out, total)
    on_bytes = progress(total) if progress is not None else None
    _write_vision_file(out / SINGLE_FILE, plan, reader, on_bytes, f"hf://{ref.repo_id}@{commit}")
    return Fetched(
        path=str(out),
        repo=ref.repo_id,
        revision=ref.revision,
        commit=commit,
        bytes_read=reader.bytes_read,
        vision_bytes=total,
        repo_shard_bytes=sum(sizes[s] for s in shards),
        shards=len(shards),
        shards_read=len(plan),
        seconds=0.0,
    )


@dataclass(frozen=True)
class Span:
    """One vision tensor in a shard: its header entry and absolute byte range."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


def _vision_plan(
    ref: HubRef, commit: str, sizes: dict[str, int], reader: RangeReader, hub: Hub
) -> list[tuple[str, list[Span]]]:
    """[(shard, its vision tensors in file order)] from the index (or the single file)."""
    wanted = _wanted(ref, commit, sizes, hub)
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


def _wanted(ref: HubRef, commit: str, sizes: dict[str, int], hub: Hub) -> dict[str, list[str]]:
    """{shard: vision keys the index lists in it}; {single file: []} without an index."""
    if INDEX_FILE in sizes:
        index = json.loads(_small_file(hub, ref, commit, INDEX_FILE).read_text())
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


def _merged(spans: list[Span]) -> list[tuple[int, int]]:
    """Adjacent byte ranges merged: one request for tensors that lie back to back.

    >>> _merged([Span("a", "F32", (1,), 8, 12), Span("b", "F32", (1,), 12, 16),
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


def _check_room(out: Path, needed: int) -> None:
    free = shutil.disk_usage(out).free
    if free < needed:
        raise OSError(
            errno.ENOSPC,
            f"{human_bytes(needed)} needed, {human_bytes(free)} free",
        )


def _write_vision_file(
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
            for start, end in _merged(spans):
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
                    _hub_errors(self.ref, shard),
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
def _hub_errors(ref: HubRef, what: str) -> Iterator[None]:
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
        status = _status(exc)
        hint = (
            "it is private or gated: set HF_TOKEN to a token with access to it"
            if status in (401, 403)
            else "check the name"
        )
        raise HubError(
            f"No repository {ref.repo_id!r} at {_endpoint()} (HTTP {status}, reading {what}); "
            f"{hint}, or that HF_ENDPOINT is the hub you mean."
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
            f"({exc}); unset HF_HUB_OFFLINE or check the network to {_endpoint()}."
        ) from exc
    except HfHubHTTPError as exc:
        status = _status(exc)
        if status in (401, 403):
            raise HubError(
                f"{_endpoint()} refused {ref} (HTTP {status}, reading {what}): set HF_TOKEN to "
                "a token with read access to it."
            ) from exc
        raise HubError(f"Reading {what} of {ref} failed: {exc}") from exc


def _status(exc) -> int | None:
    response = getattr(exc, "response", None)
    return getattr(response, "status_code", None)


def _endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


# --- progress -------------------------------------------------------------------------


def log_progress(
    name: str, logger: logging.Logger, every_s: float = 5.0
) -> Callable[[int], Progress]:
    """Progress as log lines (a rank's log): one every ``every_s`` and one at the end."""

    def start(total: int) -> Progress:
        state = {"done": 0, "last": time.monotonic(), "t0": time.monotonic()}
        logger.info("fetching %s: %s of vision tensors", name, human_bytes(total))

        def on_bytes(n: int) -> None:
            state["done"] += n
            now = time.monotonic()
            if now - state["last"] >= every_s or state["done"] >= total:
                state["last"] = now
                rate = state["done"] / max(now - state["t0"], 1e-9)
                logger.info(
                    "fetching %s: %s of %s (%.0f%%), %s/s",
                    name,
                    human_bytes(state["done"]),
                    human_bytes(total),
                    100 * state["done"] / max(total, 1),
                    human_bytes(rate),
                )

        return on_bytes

    return start


def bar_progress(name: str) -> Callable[[int], Progress]:
    """huggingface_hub's progress bar in bytes (off with HF_HUB_DISABLE_PROGRESS_BARS)."""
    from huggingface_hub.utils import tqdm

    def start(total: int) -> Progress:
        bar = tqdm(total=total, unit="B", unit_scale=True, desc=name, mininterval=0.5)

        def on_bytes(n: int) -> None:
            bar.update(n)
            if bar.n >= total:
                bar.close()

        return on_bytes

    return start
