"""Every switch of a rank side by side in one device run (benchmarks/gpu_served.py): the
tower's execution mode (eager, compiled, graphs) x the rank's decode (threads, processes).

- ``tower_modes`` (the tower section): the tower alone in each mode on the same weights,
  built in turn on one model (``kimi_encoder.execution.build``) and undone after: its
  build time, its TFLOP/s on the plan's FLOP batch (16 x 1024 patches on the GPU: the
  datasheet's share with the best mode), and its images/s on the square and the mixed
  sets, each as large a batch as a rank's. The fastest mode per set is the denominator
  of every ratio of the run (``Context.tower``); each mode's own rates stay too
  (``Context.tower_by_mode``), so that a variant is also read against its own mode.
- ``section_switches``: one app per variant in the proxy's ``serve run`` (dp 1, both
  caches off, ``device_apps.run_apps``): all of them start together, which costs one
  start instead of one per variant, and the windows load one app at a time. A variant
  this device cannot run (graphs without CUDA) is reported with the reason; one whose
  mode failed to build in the tower section is not started. Each variant's answers are
  checked against the in-process encoder, then the windows go round the variants (8 and
  1 images per request, then the mixed set), so that each kind of window is measured
  for every variant before the next kind begins, and a burst of load elsewhere falls
  on all of them. A variant that fails (its start, its answers, a window) is recorded
  with its error and the others go on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from benchmarks.common import Section, SectionTimeout, Skip
from benchmarks.device import H200_DATASHEET_TFLOPS, time_mix
from benchmarks.device_apps import Context, check_answers, rank_info, server, window
from benchmarks.inprocess import tower_only_rate
from benchmarks.served import multipart_bodies
from kimi_encoder.encoder import VisionEncoder
from kimi_encoder.execution import (
    Execution,
    ExecutionConfig,
    build,
    default_buckets,
    graphs_unsupported,
)

MODES = ("eager", "compiled", "graphs")
DECODES = ("threads", "processes")


def unsupported(mode: str, device: str, dtype: str) -> str | None:
    """Why ``mode`` cannot run on ``device`` in ``dtype`` (as the library says), or None."""
    if mode != "graphs":
        return None
    return graphs_unsupported(torch.device(device), getattr(torch, dtype))


def variant(mode: str, decode: str) -> str:
    return f"{mode}-{decode}"


def variant_apps(ctx: Context) -> dict[str, dict]:
    """The apps of the variants this device can run, by name: their args (flat names)."""
    plan = ctx.plan
    base = {"feature_cache_bytes": 0, "ingress_cache_bytes": 0, **plan.variant_args}
    return {
        variant(mode, decode): {**base, "dp_size": 1, "execution": mode, "decode": decode}
        for mode in MODES
        if not unsupported(mode, plan.device, plan.dtype)
        for decode in DECODES
    }


# --------------------------------------------------------------------------- the tower


def tower_modes(sec: Section, ctx: Context, enc: VisionEncoder, batch_patches: int) -> None:
    """The tower alone in each mode (module docstring); sets ``ctx.tower`` and the rest."""
    plan = ctx.plan
    summary: dict[str, dict] = {}
    for mode in MODES:
        why = unsupported(mode, plan.device, plan.dtype)
        if why:
            summary[mode] = {"status": f"not possible here: {why}"}
        elif sec.fits(f"the tower, {mode}", 8 * plan.timed_s):
            summary[mode] = tower_mode(sec, ctx, enc, mode, batch_patches)
    sec.record("tower by mode", summary)
    if not ctx.tower_by_mode:
        raise RuntimeError(f"no execution mode ran the tower: {summary}")
    for kind in ("square", "mixed"):
        best = max(ctx.tower_by_mode, key=lambda m: ctx.tower_by_mode[m][kind])
        ctx.tower[kind] = ctx.tower_by_mode[best][kind]
        sec.record(f"tower, {kind} set", {"mode": best, "images_per_s": ctx.tower[kind]})
    ctx.best_mode = max(ctx.tower_by_mode, key=lambda m: ctx.tower_by_mode[m]["square"])


def tower_mode(sec: Section, ctx: Context, enc: VisionEncoder, mode: str, batch_patches: int):
    """``mode`` built on ``enc``'s model, measured, undone: its row of the summary. A mode
    that fails to build is not served either (``ctx.mode_errors``)."""
    plan, eager = ctx.plan, enc.execution
    config = ExecutionConfig(graph_buckets=default_buckets(batch_patches))
    most = max(plan.per_request) * max(plan.clients)  # images in flight at most
    name, grids = plan.flops_mix
    try:
        built = build(mode, enc.model, config)
    except SectionTimeout:
        raise
    except Exception as exc:  # noqa: BLE001 - recorded: the variant is not served either
        ctx.mode_errors[mode] = f"{type(exc).__name__}: {str(exc)[:400]}"
        return {"status": f"build failed: {ctx.mode_errors[mode]}"}
    row = {"status": "ok", "build_s": built.build_s}
    try:
        enc.execution = Execution(mode, built.run, {"requested": mode})
        flops = time_mix(built.run, enc.vision, list(grids), plan.device, plan.timed_s)
        if plan.device == "cuda":
            flops["of_datasheet_989"] = flops["tflops"] / H200_DATASHEET_TFLOPS
        sec.record(f"{mode}, {name}", flops)
        row[f"{name} tflops"] = flops["tflops"]
        row["of_datasheet_989"] = flops.get("of_datasheet_989")
        rates = {}
        for kind, images in (("square", ctx.images), ("mixed", ctx.mixed)):
            measured = tower_only_rate(enc, images, batch_patches, most, plan.timed_s)
            sec.record(f"{mode}, {kind} set", measured)
            rates[kind] = row[f"{kind} images_per_s"] = measured["images_per_s"]
    except SectionTimeout:
        raise
    except Exception as exc:  # noqa: BLE001 - recorded; the other modes still run
        return row | {"status": f"failed: {type(exc).__name__}: {str(exc)[:400]}"}
    finally:
        enc.execution = eager
        built.undo()
    ctx.tower_by_mode[mode] = rates
    return row


# --------------------------------------------------------------------------- served


@dataclass
class Matrix:
    """Each variant's row, and why each that failed did (it is measured no further)."""

    rows: dict[str, dict] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, ctx: Context) -> Matrix:
        """Rows for the variants this device cannot run, saying why; those whose mode did
        not build in the tower section failed (not started)."""
        matrix = cls()
        for mode in MODES:
            why = unsupported(mode, ctx.plan.device, ctx.plan.dtype)
            for decode in DECODES:
                if why:
                    matrix.rows[variant(mode, decode)] = {"status": f"not possible here: {why}"}
                elif mode in ctx.mode_errors:
                    matrix.fail(variant(mode, decode), f"not started: {ctx.mode_errors[mode]}")
        return matrix

    def fail(self, name: str, what: str, exc: BaseException | None = None) -> None:
        self.failed[name] = what + (f": {type(exc).__name__}: {str(exc)[:400]}" if exc else "")

    def serving(self, names) -> list[str]:
        return [name for name in names if name not in self.failed]

    def table(self) -> dict[str, dict]:
        out = dict(self.rows)
        for name, error in self.failed.items():
            out[name] = {**out.get(name, {}), "status": f"failed: {error}"}
        return out


def windows(ctx: Context) -> list[tuple[str, list, int, str]]:
    """(label, bodies, clients, the tower's set) of each kind of window, in order."""
    square = [
        (f"{per} x {clients}", multipart_bodies(ctx.images, per), clients, "square")
        for per, clients in ctx.plan.switch_windows
    ]
    clients = ctx.plan.switch_windows[0][1]
    return [*square, (f"mixed 8 x {clients}", multipart_bodies(ctx.mixed, 8), clients, "mixed")]


def wait_live(run, names: list[str], deadline: float) -> dict[str, float]:
    """Seconds from the start until each of ``names`` was live, for those that were by
    ``deadline`` (``time.monotonic``; each checked once more after it)."""
    ready: dict[str, float] = {}
    while True:
        last = time.monotonic() >= deadline
        for name in names:
            if name not in ready and run.live(f"/{name}"):
                ready[name] = time.monotonic() - run.started
        if last or len(ready) == len(names):
            return ready
        time.sleep(0.5)


def section_switches(sec: Section, ctx: Context) -> None:
    plan, kinds, matrix = ctx.plan, windows(ctx), Matrix.of(ctx)
    names = matrix.serving(ctx.variant_apps)
    if not names:
        sec.record("variants", matrix.table())
        raise Skip("no variant to serve here (see variants)")
    run = server(ctx, "proxy", sec, apps=())
    per_window = plan.switch_warm_s + plan.switch_window_s + 2.0  # with the clients' start
    needs = len(names) * (len(kinds) * per_window + 2.0)
    ready = wait_live(run, names, time.monotonic() + max(30.0, sec.left() - needs))
    sec.record("ready_s", ready)
    for name in names:
        if name not in ready:
            matrix.fail(name, f"not live after {time.monotonic() - run.started:.0f} s")
        else:
            start_variant(sec, ctx, run, name, matrix)
    for label, bodies, clients, tower in kinds:
        for name in matrix.serving(names):
            if sec.fits(f"{name}, {label}", per_window):
                measure(sec, ctx, run, name, (label, bodies, clients, tower), matrix)
    sec.record("variants", matrix.table())
    rows = [r for r in sec.results.values() if isinstance(r, dict) and "errors" in r]
    errors = sum(r["errors"] for r in rows)
    sec.check("every variant served and answered", not matrix.failed, failed=sorted(matrix.failed))
    sec.check("every request answered 200", errors == 0, errors=errors, windows=len(rows))


def start_variant(sec: Section, ctx: Context, run, name: str, matrix: Matrix) -> None:
    """A live variant's answers checked; its row opened with how its rank runs."""
    try:
        info = rank_info(run, name)
        check_answers(sec, ctx, run, name)
    except SectionTimeout:
        raise
    except Exception as exc:  # noqa: BLE001 - recorded; the other variants go on
        matrix.fail(name, "answers", exc)
        return
    execution, procs = info.get("execution") or {}, info.get("decode_processes") or {}
    matrix.rows[name] = {
        "status": "ok",
        "mode": execution.get("mode"),
        "build_s": execution.get("build_s"),
        "decode": ctx.variant_apps[name]["decode"],
        "decode_workers": procs.get("workers", 0),
    }


def measure(sec: Section, ctx: Context, run, name: str, kind: tuple, matrix: Matrix) -> None:
    """One window of ``kind`` on the variant ``name``: its row, and its figures in the
    variant's row of the matrix (the first kind's also from inside the rank)."""
    label, bodies, clients, tower = kind
    try:
        row = window(ctx, run, name, bodies, clients, tower, ctx.plan.switch_load(clients))
    except SectionTimeout:
        raise
    except Exception as exc:  # noqa: BLE001 - recorded; the other variants go on
        matrix.fail(name, label, exc)
        return
    own = ctx.tower_by_mode.get(matrix.rows[name]["mode"], {}).get(tower)
    if own:
        row["of_own_mode_tower"] = row["images_per_s"] / own
    sec.record(f"{name}, {label}", row)
    matrix.rows[name][f"{label} of_tower"] = row["of_tower"]
    if label == windows_first(ctx):  # 8 images per request: the rank's batches full
        rank = row["rank"]
        keys = ("forward_of_tower", "forward_wait_ms", "gpu_busy")
        matrix.rows[name] |= {key: rank.get(key) for key in keys}


def windows_first(ctx: Context) -> str:
    per, clients = ctx.plan.switch_windows[0]
    return f"{per} x {clients}"
