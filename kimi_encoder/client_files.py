"""``encode_files``: a whole set of files through ``EncoderClient``, for the CLI.

Each distinct image (by SHA-256 of its bytes) is sent once, in batches with bounded
concurrency, and a bad file fails alone: the rest of its batch is retried without it.
Features are written next to a mirror of the inputs, as safetensors.
"""

from __future__ import annotations

import glob
import hashlib
import json
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import numpy as np

from .client import IMAGE_SUFFIXES, ITEM_STATUSES, Encoded, EncodeError, EncoderClient
from .features import SAFETENSORS, safetensors_body


@dataclass
class Source:
    """One distinct image: its bytes' digest and every input file holding those bytes."""

    digest: str
    paths: list[Path]
    outputs: list[Path]


@dataclass
class RunReport:
    """What ``encode_files`` did."""

    files: int = 0
    unique: int = 0
    encoded: int = 0  # distinct images encoded
    patches: int = 0
    requests: int = 0
    retries: int = 0
    seconds: float = 0.0
    written: list[Path] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # input path -> reason


def expand_inputs(inputs: Iterable[str]) -> tuple[list[tuple[Path, Path]], dict[str, str]]:
    """``(file, name under --out)`` for files, directories (recursive) and globs; misses.

    A directory contributes its image files (by suffix) named by their path inside it;
    a file or a glob match is named by its file name.
    """
    found: list[tuple[Path, Path]] = []
    missing: dict[str, str] = {}
    for spec in inputs:
        path = Path(spec)
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file())
            found += [(p, p.relative_to(path)) for p in files if p.suffix.lower() in IMAGE_SUFFIXES]
        elif path.is_file():
            found.append((path, Path(path.name)))
        elif glob.has_magic(spec):
            matches = sorted(Path(p) for p in glob.glob(spec, recursive=True))
            files = [p for p in matches if p.is_file()]
            if not files:
                missing[spec] = "the pattern matches no file"
            found += [(p, Path(p.name)) for p in files]
        else:
            missing[spec] = "no such file or directory"
    return found, missing


def plan_sources(
    files: Sequence[tuple[Path, Path]], out_dir: Path, report: RunReport
) -> list[Source]:
    """Group the files by content digest (each distinct image is sent once)."""
    by_digest: dict[str, Source] = {}
    taken: set[Path] = set()
    for path, name in files:
        try:
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
        except OSError as exc:
            report.failed[str(path)] = f"cannot read: {exc.strerror or exc}"
            continue
        out = out_dir / name.with_name(name.name + ".safetensors")
        if out in taken:  # two inputs with one name (a.png in two globs): tell them apart
            out = out.with_name(f"{name.name}.{digest[:12]}.safetensors")
        taken.add(out)
        source = by_digest.setdefault(digest, Source(digest, [], []))
        source.paths.append(path)
        source.outputs.append(out)
    report.files = len(files)
    report.unique = len(by_digest)
    return list(by_digest.values())


class Progress:
    """One line on a terminal: done/total, img/s, patches/s, ETA (redrawn in place)."""

    def __init__(self, total: int, stream: IO[str], enabled: bool, min_interval_s: float = 0.1):
        self.total = total
        self.stream = stream
        self.enabled = enabled
        self.min_interval_s = min_interval_s
        self.started = time.monotonic()
        self.done = 0
        self.failed = 0
        self.patches = 0
        self._drawn = 0.0

    def update(self, images: int, patches: int, failed: int = 0) -> None:
        self.done += images + failed
        self.failed += failed
        self.patches += patches
        now = time.monotonic()
        if now - self._drawn >= self.min_interval_s or self.done >= self.total:
            self.draw(now)

    def line(self, now: float | None = None) -> str:
        elapsed = max(1e-9, (now or time.monotonic()) - self.started)
        rate = self.done / elapsed
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        width = 24
        filled = int(width * self.done / self.total) if self.total else width
        eta_text = _clock(eta) if eta != float("inf") else "--:--"
        failed = f" {self.failed} failed" if self.failed else ""
        return (
            f"[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} images{failed}"
            f" | {rate:.1f} img/s | {self.patches / elapsed:,.0f} patches/s | ETA {eta_text}"
        )

    def draw(self, now: float | None = None) -> None:
        if self.enabled:
            self._drawn = now or time.monotonic()
            self.stream.write("\r\x1b[2K" + self.line(now))
            self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.draw()
            self.stream.write("\n")
            self.stream.flush()


def encode_files(
    client: EncoderClient,
    sources: Sequence[Source],
    *,
    batch_size: int = 8,
    concurrency: int = 4,
    per_batch: bool = False,
    out_dir: Path | None = None,
    progress: Progress | None = None,
    report: RunReport | None = None,
) -> RunReport:
    """Encode every source once and write its outputs; failures are named in the report.

    ``per_batch``: one ``batch-NNNNN.safetensors`` per request in ``out_dir`` instead of
    one file per input (``Source.outputs``).
    """
    if batch_size < 1 or concurrency < 1:
        raise ValueError(
            f"--batch-size and --concurrency must be at least 1 (got {batch_size} and "
            f"{concurrency}); keep the batch size at or below the server's "
            "max_images_per_request."
        )
    report = report or RunReport()
    started = time.monotonic()
    batches = [list(sources[i : i + batch_size]) for i in range(0, len(sources), batch_size)]
    lock = threading.Lock()

    def run(number: int, batch: list[Source]) -> tuple[int, int, int]:
        """Files done, patches encoded, files failed."""
        done, failed = _encode_isolating(client, batch, report, lock)
        patches = sum(int(np.prod(e.grid_thw)) for _, e in done)
        written = _write_batch(client, number, done, per_batch, out_dir)
        with lock:
            report.encoded += len(done)
            report.patches += patches
            report.written += written
        return sum(len(s.paths) for s, _ in done), patches, failed

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        pending: set[Future] = set()
        queue = iter(enumerate(batches))
        while True:
            while len(pending) < 2 * concurrency:  # bounded: files are read when sent
                try:
                    number, batch = next(queue)
                except StopIteration:
                    break
                pending.add(pool.submit(run, number, batch))
            if not pending:
                break
            finished, pending = wait(pending, return_when=FIRST_COMPLETED)
            for future in finished:
                images, patches, failed = future.result()
                if progress is not None:
                    progress.update(images, patches, failed)
    report.retries = client.retries
    report.seconds = time.monotonic() - started
    return report


def _encode_isolating(
    client: EncoderClient, batch: list[Source], report: RunReport, lock: threading.Lock
) -> tuple[list[tuple[Source, Encoded]], int]:
    """Encode a batch; a file the server names (``item N``) fails alone, the rest retried."""
    done: list[tuple[Source, Encoded]] = []
    failed = 0
    todo = [batch]
    while todo:
        part = todo.pop()
        data: list[bytes] = []
        readable: list[Source] = []
        for source in part:
            try:
                data.append(source.paths[0].read_bytes())
                readable.append(source)
            except OSError as exc:
                failed += _fail(report, lock, source, f"cannot read: {exc.strerror or exc}")
        if not readable:
            continue
        with lock:
            report.requests += 1
        try:
            results = client.encode(data)
        except EncodeError as exc:
            culprit = exc.item
            if exc.status in ITEM_STATUSES and culprit is not None and culprit < len(readable):
                failed += _fail(report, lock, readable[culprit], exc.message)
                rest = readable[:culprit] + readable[culprit + 1 :]
                if rest:
                    todo.append(rest)
            elif exc.status in ITEM_STATUSES and len(readable) > 1:  # not named: bisect
                half = len(readable) // 2
                todo += [readable[half:], readable[:half]]
            else:
                for source in readable:
                    failed += _fail(report, lock, source, str(exc))
            continue
        done += list(zip(readable, results, strict=True))
    return done, failed


def _fail(report: RunReport, lock: threading.Lock, source: Source, reason: str) -> int:
    with lock:
        for path in source.paths:
            report.failed[str(path)] = reason
    return len(source.paths)


def _write_batch(
    client: EncoderClient,
    number: int,
    done: list[tuple[Source, Encoded]],
    per_batch: bool,
    out_dir: Path | None,
) -> list[Path]:
    model = client.model or ""
    if per_batch:
        if not done or out_dir is None:
            return []
        tensors: dict[str, tuple[np.ndarray, str]] = {}
        for i, (_, encoded) in enumerate(done):
            tensors[f"features.{i}"] = (encoded.raw, SAFETENSORS[encoded.dtype])
            tensors[f"grid_thw.{i}"] = (np.asarray([encoded.grid_thw], dtype=np.int64), "I64")
        meta = {
            "model": model,
            "owner_ranks": json.dumps([e.owner_rank for _, e in done]),
            "files": json.dumps([[str(p) for p in s.paths] for s, _ in done]),
            "sha256": json.dumps([s.digest for s, _ in done]),
        }
        path = out_dir / f"batch-{number:05d}.safetensors"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(safetensors_body(tensors, meta))
        return [path]
    written = []
    for source, encoded in done:
        tensors = {
            "features": (encoded.raw, SAFETENSORS[encoded.dtype]),
            "grid_thw": (np.asarray([encoded.grid_thw], dtype=np.int64), "I64"),
        }
        for path, out in zip(source.paths, source.outputs, strict=True):
            meta = {
                "model": model,
                "owner_rank": str(encoded.owner_rank),
                "source": str(path),
                "sha256": source.digest,
            }
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(safetensors_body(tensors, meta))
            written.append(out)
    return written


def _clock(seconds: float) -> str:
    seconds = round(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


def run_client(
    url: str,
    inputs: Sequence[str],
    out_dir: Path,
    *,
    batch_size: int = 8,
    concurrency: int = 4,
    per_batch: bool = False,
    backend: str | None = None,
    feature_dtype: str | None = None,
    api_key: str | None = None,
    stream: IO[str] = sys.stderr,
) -> RunReport:
    """What ``kimi-encoder client`` does: expand, dedupe, encode, write, report."""
    report = RunReport()
    files, missing = expand_inputs(inputs)
    report.failed.update(missing)
    sources = plan_sources(files, out_dir, report)
    client = EncoderClient(url, backend=backend, feature_dtype=feature_dtype, api_key=api_key)
    progress = Progress(report.files, stream, enabled=stream.isatty())
    progress.update(0, 0, failed=len(report.failed) - len(missing))  # unreadable at scan
    try:
        encode_files(
            client,
            sources,
            batch_size=batch_size,
            concurrency=concurrency,
            per_batch=per_batch,
            out_dir=out_dir,
            progress=progress,
            report=report,
        )
    finally:
        progress.close()
    return report
