"""The ``compiled`` mode: ``torch.compile`` of the tower's pieces between attention calls,
built one piece at a time, once per node, with a bounded pool of compile workers.

**Pieces** (``pieces``): the patch embedding, each block's pre-attention and
post-attention parts (every block runs the same code: each is compiled once) and the
projector; ``kimi_encoder.model`` says why attention stays outside them. The patch or
token count is an unbacked dynamic dimension of each, so one compilation serves every
batch. The pieces are put in place one at a time, each compiled by a forward over two
small synthetic images (``warm_up``) before the next, and a ``Deadline`` (``auto``'s
budget) is read between them: a build ends at most one piece's compile past it, and a
build it stops is undone (``BudgetSpent``).

**Compile workers.** Inductor compiles a graph's kernels in a pool of
``torch._inductor.config.compile_threads`` worker processes, min(32, cores) by default,
in every process that compiles: 256 processes for 8 ranks on a 32-core node.
``bound_compile_threads`` sets it from the rank's CPUs, at most ``MAX_COMPILE_THREADS``,
before the build (the pool is made at a process's first compile);
``TORCHINDUCTOR_COMPILE_THREADS``, when set, is kept.

**One compile per node.** Inductor keeps what it compiled on disk (its FX graph cache and
AOT autograd cache) in ``TORCHINDUCTOR_CACHE_DIR``, by default
``<tempdir>/torchinductor_<user>``: one folder per user and node. A process that finds a
piece there loads it instead of compiling it, but ranks that start together would all miss
it and compile the same pieces at once. So a build holds a ``flock`` on ``LOCK_NAME`` in
that folder: the first process to come holds it alone and compiles; the others wait for it,
then hold it shared and load, side by side (docs/benchmarks.md, "Compiled start: the second
rank against the first"). The deadline bounds that wait too.

**Fallbacks.** Once dynamo has compiled a function ``recompile_limit`` times (new dtypes,
kinds of tensor, grad modes), it runs it eagerly with one logged warning. While compiled
pieces are in place the process has dynamo's ``fail_on_recompile_limit_hit`` on, so that
raises instead: the piece catches it, runs that call eagerly and counts it
(``compiled_fallbacks`` in ``CompiledRun.info`` and ``/v1/info``).
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from .model import Grid, KimiVisionModel

log = logging.getLogger(__name__)

# A rank's pieces are four graphs of a few dozen kernels each: a few workers compile them
# about as fast as many, and 8 ranks on a node then start 32 workers, not 256.
MAX_COMPILE_THREADS = 4
LOCK_NAME = "kimi-encoder-compile.lock"
LOCK_POLL_S = 0.05  # how often a build with a deadline tries the node's lock again

Target = tuple[torch.nn.Module, str]  # a module and the name of the method compiled on it


class BudgetSpent(Exception):
    """A build stopped by its deadline; what it had built is undone."""


@dataclass(frozen=True)
class Deadline:
    """A time on ``clock`` that a build reads between its steps; ``at`` None: none."""

    at: float | None = None
    clock: Callable[[], float] = time.perf_counter

    @classmethod
    def after(cls, seconds: float, clock: Callable[[], float] = time.perf_counter) -> Deadline:
        return cls(clock() + seconds, clock)

    def passed(self) -> bool:
        return self.at is not None and self.clock() >= self.at


def bound_compile_threads(cpus: int | None = None) -> int:
    """Inductor's compile workers in this process: ``cpus`` (a rank's CPUs; None: the CPUs
    this process may run on), at least 1 and at most ``MAX_COMPILE_THREADS``; an explicit
    ``TORCHINDUCTOR_COMPILE_THREADS`` is kept. Only a process's first compile reads it."""
    from torch._inductor import config as inductor_config  # imports dynamo: on first use

    if "TORCHINDUCTOR_COMPILE_THREADS" not in os.environ:
        usable = len(os.sched_getaffinity(0)) if cpus is None else cpus
        inductor_config.compile_threads = max(1, min(MAX_COMPILE_THREADS, usable))
    return inductor_config.compile_threads


def lock_path() -> Path:
    """The node's compile lock: a file in inductor's cache directory, which all its ranks
    share."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir  # imports dynamo

    return Path(cache_dir()) / LOCK_NAME


@contextmanager
def node_lock(deadline: Deadline) -> Iterator[float]:
    """The node's compile lock held for the block (module docstring); yields the seconds
    spent waiting for it. The first process to come holds it alone and compiles; one that
    finds it held waits, then holds it shared with the others that waited, so they load
    side by side. ``BudgetSpent`` when ``deadline`` passes before it is held."""
    path = lock_path()
    started = time.perf_counter()
    with path.open("a") as handle:
        if not _try_lock(handle, fcntl.LOCK_EX):
            if deadline.at is None:
                fcntl.flock(handle, fcntl.LOCK_SH)
            while deadline.at is not None and not _try_lock(handle, fcntl.LOCK_SH):
                if deadline.passed():
                    raise BudgetSpent("waiting for another process's compile")
                time.sleep(LOCK_POLL_S)
        try:
            yield time.perf_counter() - started
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _try_lock(handle, kind: int) -> bool:
    try:
        fcntl.flock(handle, kind | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def pieces(model: KimiVisionModel) -> list[tuple[str, list[Target]]]:
    """Each compiled piece by name, with the methods it takes the place of."""
    tower, blocks = model.vision_tower, model.vision_tower.encoder.blocks
    return [
        ("patch embedding", [(tower.patch_embed, "forward")]),
        ("pre-attention", [(block, "pre_attention") for block in blocks]),
        ("post-attention", [(block, "post_attention") for block in blocks]),
        ("projector", [(model.mm_projector, "forward")]),
    ]


def warm_up(model: KimiVisionModel) -> None:
    """One forward over two small synthetic images: compiles what is compiled lazily."""
    p, device = model.cfg.patch_size, model.vision_tower.patch_embed.proj.weight.device
    model(torch.zeros(4 + 24, 3, p, p, device=device), [(1, 2, 2), (1, 4, 6)])


class CompiledRun:
    """A model with compiled pieces in place: called as the model is. ``fallbacks``
    counts the piece calls that ran eagerly (module docstring, "Fallbacks")."""

    def __init__(self, model: KimiVisionModel):
        self.model = model
        self.fallbacks = 0
        self.report: dict = {}
        self._targets: list[Target] = []

    def __call__(self, pixels: torch.Tensor, grids: Sequence[Grid]) -> torch.Tensor:
        return self.model(pixels, grids)

    def put(self, targets: Sequence[Target]) -> None:
        """Compiled versions in place of ``targets`` (compiled at their first call)."""
        if not self._targets:
            _fail_at_recompile_limit(+1)
        for owner, name in targets:
            eager = getattr(owner, name)
            setattr(owner, name, _rows_dynamic(torch.compile(eager), eager, self._fell_back))
            self._targets.append((owner, name))

    def undo(self) -> None:
        """The model's own methods back in place."""
        for owner, name in self._targets:
            delattr(owner, name)  # the class's own method shows again
        if self._targets:
            _fail_at_recompile_limit(-1)
        self._targets.clear()

    def _fell_back(self) -> None:
        if not self.fallbacks:
            log.warning(
                "a compiled piece hit dynamo's recompile limit: such calls run eagerly, "
                "counted in compiled_fallbacks"
            )
        self.fallbacks += 1

    def info(self) -> dict:
        return {**self.report, "compiled_fallbacks": self.fallbacks}


def build_compiled(
    model: KimiVisionModel, deadline: Deadline | None = None, cpus: int | None = None
) -> CompiledRun:
    """``model`` with its pieces compiled one at a time under the node's lock, reading
    ``deadline`` (None: none) between them (module docstring); undone if anything fails.
    ``cpus``: the compile workers' bound (``bound_compile_threads``)."""
    deadline = deadline or Deadline()
    threads = bound_compile_threads(cpus)
    run, todo = CompiledRun(model), pieces(model)
    before = _cache_counts()
    with node_lock(deadline) as waited:
        started = time.perf_counter()
        try:
            for done, (_, targets) in enumerate(todo):
                if deadline.passed():
                    raise BudgetSpent(f"after {done} of {len(todo)} pieces compiled")
                run.put(targets)
                warm_up(model)
        except BaseException:
            run.undo()
            raise
        build_s = time.perf_counter() - started
    hits, misses = (after - first for after, first in zip(_cache_counts(), before, strict=True))
    run.report = {
        "compile_s": round(build_s, 2),
        "compile_wait_s": round(waited, 2),
        "compile_threads": threads,
        "compile_cache": {"hit": hits, "miss": misses},
    }
    return run


def _cache_counts() -> tuple[int, int]:
    """Inductor's FX graph cache hits and misses in this process so far."""
    from torch._dynamo.utils import counters  # dynamo on first use (model.varlen_function)

    inductor = counters["inductor"]
    return inductor["fxgraph_cache_hit"], inductor["fxgraph_cache_miss"]


_failing = {"holders": 0, "before": False}  # runs with pieces in place; the setting before


def _fail_at_recompile_limit(change: int) -> None:
    """Dynamo raises at its recompile limit while any run has pieces in place (module
    docstring, "Fallbacks"); its own setting comes back after the last is undone."""
    dynamo = torch._dynamo.config
    if dynamo.suppress_errors:  # the two cannot both be on: dynamo falls back on its own
        log.warning("TORCHDYNAMO_SUPPRESS_ERRORS is set: compiled fallbacks go uncounted")
        return
    if change > 0 and _failing["holders"] == 0:
        _failing["before"] = dynamo.fail_on_recompile_limit_hit
        dynamo.fail_on_recompile_limit_hit = True
    _failing["holders"] = max(0, _failing["holders"] + change)
    if change < 0 and _failing["holders"] == 0:
        dynamo.fail_on_recompile_limit_hit = _failing["before"]


def _rows_dynamic(compiled: Callable, eager: Callable, fell_back: Callable[[], None]) -> Callable:
    """``compiled`` with dim 0 (patches or tokens) of every tensor argument dynamic and
    unbacked, so no batch size, one included, compiles it again. Under inference mode a
    tensor made outside it (the position table of an image of the table's own size is a
    view of the weight) is copied first: a compiled graph is specialized on the kind of
    tensor too. A call past dynamo's recompile limit runs ``eager``, counted."""
    from torch._dynamo.exc import FailOnRecompileLimitHit

    def run(*args):
        inference = torch.is_inference_mode_enabled()
        args = [_inference_copy(arg, inference) for arg in args]
        for arg in args:
            if isinstance(arg, torch.Tensor):
                torch._dynamo.decorators.mark_unbacked(arg, 0)
        try:
            return compiled(*args)
        except FailOnRecompileLimitHit:
            fell_back()
            return eager(*args)

    return run


def _inference_copy(arg, inference: bool):
    if inference and isinstance(arg, torch.Tensor) and not arg.is_inference():
        return arg.clone()
    return arg
