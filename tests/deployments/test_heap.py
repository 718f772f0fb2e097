"""deployments/heap.py: ``malloc_trim`` gives scattered free heap pages back, and a replica
trims on its own every ``malloc_trim_s`` seconds.

Each process test runs in a Python of its own with the app's default ``glibc_tunables``
(large blocks kept in the heaps, no trim below 256 MB free): it fills the heap with
blocks of many sizes, frees every other one (free space scattered between blocks still
in use, as images of many shapes leave it) and reads its own ``RssAnon``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from deployments import heap
from deployments.args import GLIBC_TUNABLES, AppArgs
from deployments.args.base import TRIM_ENV

FRAGMENT = """
import json, random, sys, time
from deployments import heap

def rss_anon_mib():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024

rng = random.Random(0)
blocks = [bytearray(rng.randint(40_000, 2_000_000)) for _ in range(200)]
full = rss_anon_mib()
del blocks[::2]  # every other block: the free space lies between blocks in use
freed = rss_anon_mib()
mode = sys.argv[1]
if mode == "call":
    heap.malloc_trim()
elif mode == "thread":
    heap.start_trimming({heap.TRIM_ENV: "0.05"})
    deadline = time.monotonic() + 30
    while rss_anon_mib() > freed - 50 and time.monotonic() < deadline:
        time.sleep(0.05)
print(json.dumps({"full": full, "freed": freed, "after": rss_anon_mib()}))
"""


def fragmented(mode: str) -> dict:
    env = {**os.environ, "GLIBC_TUNABLES": GLIBC_TUNABLES}
    env.pop(TRIM_ENV, None)
    out = subprocess.run(
        [sys.executable, "-c", FRAGMENT, mode],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return json.loads(out.stdout)


def test_freed_blocks_between_used_ones_stay_resident_until_trimmed():
    untrimmed = fragmented("none")
    assert untrimmed["freed"] > untrimmed["full"] - 5, untrimmed  # nothing given back
    trimmed = fragmented("call")
    assert trimmed["after"] < trimmed["freed"] - 100, trimmed  # about half of ~200 MiB


def test_a_replica_trims_on_its_own_every_period():
    figures = fragmented("thread")
    assert figures["after"] < figures["freed"] - 50, figures


@pytest.mark.parametrize(
    ("value", "seconds"), [("", 0.0), ("0", 0.0), ("5", 5.0), ("0.25", 0.25)], ids=str
)
def test_the_period_comes_from_the_environment(value, seconds):
    assert heap.period_s({TRIM_ENV: value}) == seconds


@pytest.mark.parametrize("value", ["-1", "often", "nan"])
def test_a_bad_period_in_the_environment_is_refused(value):
    with pytest.raises(ValueError, match=rf"{TRIM_ENV} must be .*got '{value}'"):
        heap.period_s({TRIM_ENV: value})


def test_no_period_starts_no_thread():
    assert heap.start_trimming({TRIM_ENV: "0"}) in (None, *heap._started)
    assert heap.start_trimming({}) in (None, *heap._started)


@pytest.mark.parametrize("value", [-1, float("inf"), float("nan"), "often"])
def test_the_args_refuse_a_bad_malloc_trim_s(value):
    with pytest.raises(ValueError, match="malloc_trim_s"):
        AppArgs(malloc_trim_s=value)


@pytest.mark.parametrize(("seconds", "env"), [(None, "5"), (0.5, "0.5"), (0, "0")])
def test_every_replica_gets_the_period_in_its_environment(seconds, env):
    args = AppArgs() if seconds is None else AppArgs(malloc_trim_s=seconds)
    assert args.replica_env()["runtime_env"]["env_vars"][TRIM_ENV] == env
    plain = AppArgs(glibc_tunables="").replica_env()["runtime_env"]["env_vars"]
    assert plain == {TRIM_ENV: "5"}
