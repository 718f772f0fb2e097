"""Decode in worker processes (``kimi_encoder.decode_procs``) against decode in this process.

The same pixels, bit for bit, in every PIL mode and size tests/kimi_encoder/test_backends.py covers,
with both backends; the same errors for bad files; a worker that dies fails only the
image it held and is replaced; no shared memory, descriptor or process is left behind;
an abandoned image never reaches a worker. Workers are paused and killed with signals,
and every wait is on an event (the pool's, or the kernel's ``waitid``), never a sleep.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import re
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from images import MODES, RARE_FILE_MODES, image_bytes, png_claiming
from test_backends import BACKGROUNDS, SIZES, TINY

from deployments.args import BatchingArgs
from deployments.batcher import RankBatcher
from kimi_encoder import preprocess as pp
from kimi_encoder.decode_procs import MEMFD_NAME, DecodeProcesses, DecodeWorkerDied
from kimi_encoder.encoder import VisionEncoder
from kimi_encoder.items import EncoderInputError, LimitExceededError, plan_image

BOUND_S = 60  # generous bound of every wait: a worker's start imports torch on a busy machine
PATCH = 14
BACKENDS = ("cpu", "gpu")


@pytest.fixture(scope="module")
def pool():
    with DecodeProcesses(2) as workers:
        yield workers


@pytest.fixture(scope="module")
def encoder() -> VisionEncoder:
    return VisionEncoder.from_pretrained("tiny", device="cpu", backend="cpu")


def both(pool: DecodeProcesses, data: bytes, cfg=TINY, backend: str = "cpu"):
    """(pixels, grid) of ``data`` from the host stage in this process and in a worker,
    each finished on the CPU (the gpu backend's torch ops, or nothing more)."""
    item = plan_image(data, cfg, backend)
    here = pp.host_stage(item.image, item.deferred, PATCH)
    there = pool.host_stage(item.image, item.deferred, PATCH)
    assert type(there) is type(here)
    finished = [pp.device_stage(h, item.deferred, PATCH, "cpu") for h in (here, there)]
    assert finished[0][1] == finished[1][1] == item.grid
    return finished[0][0], finished[1][0]


def assert_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype == torch.float32
    assert a.shape == b.shape
    assert torch.equal(a, b), f"max diff {(a - b).abs().max().item()}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("size", SIZES.values(), ids=SIZES.keys())
@pytest.mark.parametrize("mode", MODES + RARE_FILE_MODES)
def test_worker_pixels_equal_this_process_every_mode(pool, mode, size, backend):
    assert_equal(*both(pool, image_bytes(mode, size, seed=5), backend=backend))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("stage", ["after_resize", "before_resize"])
@pytest.mark.parametrize("bg", BACKGROUNDS.values(), ids=BACKGROUNDS.keys())
@pytest.mark.parametrize("mode", ["RGBA", "LA", "P-trns-index", "P-trns-bytes"])
def test_worker_pixels_equal_this_process_backgrounds(pool, mode, bg, stage, backend):
    cfg = dataclasses.replace(TINY, transparent_bg_config=bg, transparent_bg_fill_stage=stage)
    assert_equal(*both(pool, image_bytes(mode, (500, 300), seed=9), cfg, backend))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", ["JPEG", "WEBP", "GIF", "BMP", "TIFF"])
def test_worker_pixels_equal_this_process_formats(pool, fmt, backend):
    mode = "P" if fmt == "GIF" else "RGB"
    assert_equal(*both(pool, image_bytes(mode, (640, 480), seed=2, fmt=fmt), backend=backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_prepare_through_workers_equals_prepare_here(pool, encoder, backend):
    """What the rank runs: ``VisionEncoder.prepare`` with the workers' host stage."""
    for mode in ("RGB", "RGBA", "P", "I;16", "YCbCr"):
        item = encoder.plan(image_bytes(mode, (333, 47), seed=3), backend=backend)
        here = encoder.prepare(item)
        there = encoder.prepare(item, host_stage=pool.host_stage)
        assert here.grid == there.grid == item.grid
        assert_equal(here.pixels, there.pixels)


# Each: (file bytes, what differs in the image's preprocessing record).
def _truncated() -> tuple[bytes, dict]:
    data = image_bytes("RGB", (90, 50), seed=1)
    return data[: len(data) // 2], {}


def _garbage() -> tuple[bytes, dict]:
    data = image_bytes("RGB", (90, 50), seed=1)
    return data[:33] + bytes(range(256)) * 4, {}  # signature and IHDR, then no PNG chunk


def _over_the_pixel_limit() -> tuple[bytes, dict]:
    return image_bytes("RGB", (90, 50), seed=1), {"max_pixels": 100}


def _bomb_header() -> tuple[bytes, dict]:
    return png_claiming(40_000, 40_000), {"max_pixels": None}


BAD = {
    "truncated": (_truncated, EncoderInputError),
    "garbage": (_garbage, EncoderInputError),
    "over-max-pixels": (_over_the_pixel_limit, LimitExceededError),
    "bomb-header": (_bomb_header, LimitExceededError),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("make", "kind"), BAD.values(), ids=BAD.keys())
def test_a_bad_file_raises_the_same_error_as_here(pool, make, kind, backend):
    data, record = make()
    deferred = plan_image(image_bytes("RGB", (90, 50)), TINY, backend).deferred
    deferred = dataclasses.replace(deferred, **record)
    with pytest.raises(kind) as here:
        pp.host_stage(data, deferred, PATCH)
    errors = pool.info()["errors"]
    with pytest.raises(type(here.value)) as there:
        pool.host_stage(data, deferred, PATCH)
    assert addresses_masked(str(there.value)) == addresses_masked(str(here.value))
    assert pool.info()["errors"] == errors + 1
    assert_equal(*both(pool, image_bytes("RGB", (90, 50)), backend=backend))  # still serving


def addresses_masked(message: str) -> str:
    """Pillow names the file object it could not identify by its address, which differs
    from call to call in any process."""
    return re.sub(r" at 0x[0-9a-f]+>", " at 0x...>", message)


@contextlib.contextmanager
def stopped(*pids: int) -> Iterator[None]:
    """Workers paused (the kernel says so) until the block ends. An image sent to one is
    held: it must fit the socket's buffer (tens of kB), or its send waits too."""
    try:
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
            os.waitid(os.P_PID, pid, os.WSTOPPED | os.WNOWAIT)
        yield
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def memfd_entries() -> tuple[int, int]:
    """This process's descriptors and mappings of decode segments."""
    fds = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor, closed already
            fds += MEMFD_NAME in os.readlink(f"/proc/self/fd/{fd}")
    maps = sum(MEMFD_NAME in line for line in Path("/proc/self/maps").read_text().splitlines())
    return fds, maps


@pytest.mark.parametrize("kill", [signal.SIGKILL, signal.SIGTERM], ids=lambda s: s.name)
def test_a_dead_worker_fails_only_the_image_it_held_and_is_replaced(kill):
    data = image_bytes("RGBA", (90, 50), seed=4)
    item = plan_image(data, TINY, "cpu")
    want, _ = pp.device_stage(pp.host_stage(data, item.deferred, PATCH), item.deferred, 14, "cpu")
    with DecodeProcesses(2) as pool, ThreadPoolExecutor(2) as calls:
        first, second = pool.pids
        with stopped(first, second):
            held = [calls.submit(pool.host_stage, data, item.deferred, PATCH) for _ in range(2)]
            assert sorted(pool.wait_holding(2, BOUND_S)) == sorted([first, second])
            os.kill(first, kill)  # SIGTERM acts once the process is continued
        outcomes = []
        for call in held:
            try:
                outcomes.append(call.result(BOUND_S))
            except DecodeWorkerDied as exc:
                outcomes.append(exc)
        died = [o for o in outcomes if isinstance(o, DecodeWorkerDied)]
        assert len(died) == 1, outcomes
        assert str(died[0]) == (
            f"the decode worker process (pid {first}) killed by {kill.name} while decoding "
            "this image; a new one took its place. Send the image again; an image that kills "
            "the decoder every time cannot be encoded."
        )
        (ok,) = [o for o in outcomes if not isinstance(o, Exception)]
        assert torch.equal(ok[0], want)
        assert pool.info()["died"] == 1
        assert first not in pool.pids
        assert second in pool.pids
        for _ in range(3):  # the replacement serves, and so does the other worker
            pixels, grid = pool.host_stage(data, item.deferred, PATCH)
            assert torch.equal(pixels, want)
            assert grid == item.grid


def test_a_worker_that_died_idle_costs_no_image():
    """A worker killed between images held none: the next image goes to its replacement."""
    data = image_bytes("RGB", (90, 50), seed=1)
    item = plan_image(data, TINY, "gpu")
    with DecodeProcesses(1) as pool:
        (pid,) = pool.pids
        os.kill(pid, signal.SIGKILL)
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # dead (the pool reaps it)
        host = pool.host_stage(data, item.deferred, PATCH)
        assert isinstance(host, pp.HostImage)
        assert pool.pids != [pid]
        assert pool.info()["died"] == 1


def test_nothing_is_left_behind():
    """Segments (grown, swapped, of dead workers), their descriptors and mappings, and the
    worker processes are all gone once the pool is closed; /dev/shm holds no new name."""
    shm = set(os.listdir("/dev/shm"))
    before = memfd_entries()
    small = plan_image(image_bytes("RGB", (90, 50), seed=1), TINY, "gpu")
    big = plan_image(image_bytes("RGB", (2000, 1500), seed=1), TINY, "gpu")  # 9 MB decoded
    pool = DecodeProcesses(2, segment_bytes=1 << 20, retain_bytes=4 << 20)
    try:
        during = memfd_entries()  # a segment per worker: mmap holds a copy of its descriptor
        assert during == (before[0] + 4, before[1] + 2)
        first_pids = pool.pids
        for item in (small, big, small, big):
            pool.host_stage(item.image, item.deferred, PATCH)
        with pytest.raises(EncoderInputError):
            pool.host_stage(small.image[:200], small.deferred, PATCH)
        with stopped(*first_pids), ThreadPoolExecutor(1) as calls:
            held = calls.submit(pool.host_stage, small.image, small.deferred, PATCH)
            (victim,) = pool.wait_holding(1, BOUND_S)
            os.kill(victim, signal.SIGKILL)
            with pytest.raises(DecodeWorkerDied):
                held.result(BOUND_S)
        pool.host_stage(small.image, small.deferred, PATCH)
        assert memfd_entries() == during  # still one segment per worker
        pids = set(first_pids) | set(pool.pids)
    finally:
        pool.close()
    assert memfd_entries() == before
    assert set(os.listdir("/dev/shm")) <= shm
    for pid in pids:
        with pytest.raises(ChildProcessError):  # reaped: no process, no zombie
            os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG)


def test_a_closed_pool_refuses_work_and_says_why():
    pool = DecodeProcesses(1)
    pool.close()
    pool.close()  # twice is fine
    item = plan_image(image_bytes("RGB", (90, 50)), TINY, "cpu")
    with pytest.raises(RuntimeError, match=r"decode worker processes were closed \(the rank"):
        pool.host_stage(item.image, item.deferred, PATCH)
    with pytest.raises(ValueError, match="DecodeProcesses needs at least 1 worker, got 0"):
        DecodeProcesses(0)


# --- in the rank's batcher ---------------------------------------------------------------


def run_batcher(encoder, items, **batching) -> tuple[list, RankBatcher]:
    config = BatchingArgs(max_batch_wait_ms=0.0, **batching)
    batcher = RankBatcher(encoder, config, num_threads=1)
    try:
        results, _ = asyncio.run(batcher.encode(items, "c", "float32"))
    finally:
        batcher.close()
    return results, batcher


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_batcher_with_processes_answers_the_features_of_threads(encoder, backend):
    modes = ("RGB", "RGBA", "P-trns-bytes", "L", "I;16", "CMYK", "YCbCr")
    files = [image_bytes(mode, (150, 90), seed=i) for i, mode in enumerate(modes)]
    items = [encoder.plan(data, backend=backend) for data in files]
    threads, _ = run_batcher(encoder, items)
    processes, batcher = run_batcher(encoder, items, decode="processes", decode_threads=2)
    for a, b in zip(threads, processes, strict=True):
        assert torch.equal(a, b)
    info = batcher.info()
    assert info["batching"]["decode"] == "processes"
    assert info["decode_processes"]["images"] == len(items)
    assert 0.0 <= info["forward_wait_s"] <= info["forward_s"]
    for pid in info["decode_processes"]["pids"]:  # closed with the batcher
        with pytest.raises(ChildProcessError):
            os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG)


def test_an_abandoned_image_never_reaches_a_worker(encoder):
    """A call cancelled while its first image is in the one worker: the two behind it are
    taken back before any worker sees them."""
    items = [encoder.plan(image_bytes("RGB", (120, 90), seed=i)) for i in range(3)]
    config = BatchingArgs(max_batch_wait_ms=0.0, decode="processes", decode_threads=1)
    batcher = RankBatcher(encoder, config, num_threads=1)
    procs = batcher._procs
    (pid,) = procs.pids

    async def run():
        with stopped(pid):
            call = asyncio.ensure_future(batcher.encode(items, "gone", "float32"))
            await asyncio.to_thread(procs.wait_holding, 1, BOUND_S)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
        (after,), _ = await batcher.encode([items[0]], "next", "float32")
        return after

    try:
        after = asyncio.run(run())
    finally:
        batcher.close()
    assert isinstance(after, torch.Tensor)
    assert batcher.counters.dropped == 3
    assert procs.info()["images"] == 2  # the held image, then the next call's: no other


def test_a_bad_image_fails_alike_through_the_batcher(encoder):
    good = encoder.plan(image_bytes("RGB", (90, 50), seed=1))
    bad = encoder.plan(image_bytes("RGB", (90, 50), seed=2))
    bad.image = bad.image[: len(bad.image) // 2]
    (t_good, t_bad), _ = run_batcher(encoder, [good, bad])
    (p_good, p_bad), _ = run_batcher(encoder, [good, bad], decode="processes", decode_threads=1)
    assert torch.equal(t_good, p_good)
    assert type(p_bad) is type(t_bad) is EncoderInputError
    assert str(p_bad) == str(t_bad)


def test_a_bad_decode_setting_is_refused():
    with pytest.raises(ValueError, match=r"decode\n  Input should be 'threads' or 'processes'"):
        BatchingArgs(decode="forks")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", MODES + RARE_FILE_MODES)
def test_cuda_gpu_backend_through_workers_equals_threads(mode):
    encoder = VisionEncoder.from_pretrained("tiny", device="cuda", backend="gpu", execution="eager")
    with DecodeProcesses(1) as pool:
        for size in SIZES.values():
            item = encoder.plan(image_bytes(mode, size, seed=5))
            here = encoder.materialize([item])[0]
            prepared = encoder.prepare(item, host_stage=pool.host_stage)
            there = encoder.materialize([item], [prepared])[0]
            assert torch.equal(here, there), size
