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
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from .hub_files import (
    COMMIT,
    CONFIG_FILES,
    SINGLE_FILE,
    Hub,
    HubError,
    HubRef,
    Listing,
    Progress,
    RangeReader,
    human_bytes,
    is_hub,
    list_files,
    merged,
    small_file,
    vision_plan,
    write_vision_file,
)

__all__ = ["Fetched", "Hub", "HubError", "HubRef", "cached_path", "config_dir", "fetch", "is_hub"]

# The fetch's record, written last: a directory holding it is a finished fetch.
RECORD_FILE = "kimi-encoder-fetch.json"

log = logging.getLogger(__name__)


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
        out["source"] = f"hf://{self.repo}"
        out["seconds"] = round(self.seconds, 3)
        return out


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
        raise _offline_error(ref, None, hub)
    listing = list_files(hub, ref, ref.revision)
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
    paths = [small_file(hub, ref, commit, name) for name in CONFIG_FILES]
    return paths[0].parent


# --- the fetch ------------------------------------------------------------------------


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
            listing = list_files(hub, ref, commit)
        return _fetch_into(target, ref, hub, listing, progress, started)


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


def _offline_error(ref: HubRef, commit: str | None, hub: Hub) -> HubError:
    """Offline with nothing to start from: no commit known for ``ref``'s revision, or
    none of ``commit`` fetched."""
    what = (
        f"no fetch of {ref} is cached in"
        if commit is None
        else f"{ref} (commit {commit}) has not been fetched into"
    )
    return HubError(
        f"HF_HUB_OFFLINE is set and {what} {hub.cache(ref.repo_id)}: run "
        f"`kimi-encoder fetch {ref}` where the hub can be reached (with the same HF_HOME, "
        "or copy that folder here), or unset HF_HUB_OFFLINE."
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
    started: float,
) -> Fetched:
    """Fetch into a temporary sibling of ``target``, its record last, and rename it into
    place when whole; on any failure nothing is left behind. Called under the node lock."""
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
        fetched.path, fetched.seconds = str(target), time.perf_counter() - started
        (tmp / RECORD_FILE).write_text(json.dumps(fetched.info(), indent=1))
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
        shutil.copyfile(small_file(hub, ref, commit, name), out / name)
    shards = sorted(name for name in sizes if name.endswith(".safetensors"))
    reader = RangeReader(hub, ref, commit, sizes)
    plan = vision_plan(ref, commit, sizes, reader, hub)
    total = sum(end - start for _, spans in plan for start, end in merged(spans))
    _check_room(out, total)
    on_bytes = progress(total) if progress is not None else None
    write_vision_file(out / SINGLE_FILE, plan, reader, on_bytes, f"hf://{ref.repo_id}@{commit}")
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


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _check_room(out: Path, needed: int) -> None:
    free = shutil.disk_usage(out).free
    if free < needed:
        raise OSError(
            errno.ENOSPC,
            f"{human_bytes(needed)} needed, {human_bytes(free)} free",
        )


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
