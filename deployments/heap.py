"""Freed heap memory goes back to the kernel: ``malloc_trim(0)`` every few seconds.

The replicas run with ``glibc_tunables`` that keep large blocks in malloc's heaps and
never shrink a heap below 256 MB free (``deployments/args/base.py``), so that answer
bodies reuse pages already mapped. With images of many shapes the heaps' free space
is scattered between blocks still in use: nothing is given back, and each process's
resident memory crept up by several MiB a minute under a long mixed load.
``malloc_trim(0)`` releases every whole free page inside every heap (the pages stay
mapped and fault in again when reused), so resident memory follows what is in use.
The period is ``malloc_trim_s`` of the args, passed to every replica in its
environment (``TRIM_ENV``); docs/benchmarks.md ("Soak") has the measurements.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import os
import threading
from collections.abc import Mapping

from .args.base import TRIM_ENV

log = logging.getLogger("ray.serve")

_started: list[threading.Thread] = []  # one trimming thread per process
_lock = threading.Lock()


def malloc_trim() -> bool:
    """``malloc_trim(0)`` of this process's C library; False where there is none (not glibc)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)  # ctypes lets go of the GIL for the call
    return True


def period_s(environ: Mapping[str, str] = os.environ) -> float:
    """The trimming period this process was given (0: none)."""
    value = environ.get(TRIM_ENV, "")
    try:
        seconds = float(value) if value else 0.0
    except ValueError:
        raise ValueError(
            f"{TRIM_ENV} must be a number of seconds >= 0 (args' malloc_trim_s), got {value!r}."
        ) from None
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(
            f"{TRIM_ENV} must be a finite number >= 0 (args' malloc_trim_s), got {value!r}."
        )
    return seconds


def start_trimming(environ: Mapping[str, str] = os.environ) -> threading.Thread | None:
    """Trim every ``period_s`` seconds in a daemon thread, once per process; the thread
    (None: no period, or no glibc)."""
    seconds = period_s(environ)
    with _lock:
        if _started or not seconds or not malloc_trim():
            return _started[0] if _started else None
        thread = threading.Thread(target=_trim_every, args=(seconds,), name="malloc-trim")
        thread.daemon = True
        thread.start()
        _started.append(thread)
    log.info("malloc_trim every %.3g s", seconds)
    return thread


def _trim_every(seconds: float) -> None:
    wake = threading.Event()  # never set: the thread lives as long as the process
    while not wake.wait(seconds):
        malloc_trim()
