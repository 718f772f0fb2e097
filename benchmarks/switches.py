"""Every switch of a rank side by side in one device run (benchmarks/gpu_served.py): the
tower's execution mode (eager, graphs, compiled) x the rank's decode (threads, processes).

One app per variant in the proxy's ``serve run`` (dp 1, both caches off,
``device_apps.run_apps``), all started by the driver together with ``/off`` and ``/on``
and all live before the first window: one start instead of one per variant, and no rank
still starting during a window. A variant this device cannot run (graphs without CUDA)
is reported with the reason; one whose mode failed in its tower section is not started.
Each variant's answers are checked against the in-process encoder, then the windows go
round the variants (8 and 1 images per request, then the mixed set), so that each kind
of window is measured for every variant before the next kind begins, and a burst of
load elsewhere falls on all of them. A window's rate is a ratio to the fastest mode's
tower on its set (``of_tower``) and to its own mode's (``of_own_mode_tower``). A variant
that fails (not live, its answers, a window) is recorded with its error and the others
go on. After the windows each rank says how it ran them: its ``/v1/info`` execution as
it reports it (mode, buckets used, eager fallbacks, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from benchmarks.common import Section, SectionTimeout, Skip
from benchmarks.device_apps import (
    MODES,
    Context,
    check_answers,
    denominators,
    executions,
    rank_info,
    window,
)
from benchmarks.served import multipart_bodies

DECODES = ("threads", "processes")


def variant(mode: str, decode: str) -> str:
    return f"{mode}-{decode}"


def variant_apps(ctx: Context) -> dict[str, dict]:
    """The apps of the variants this device can run (``ctx.unsupported``), by name: their
    args (flat names)."""
    plan = ctx.plan
    base = {"feature_cache_bytes": 0, "ingress_cache_bytes": 0, **plan.variant_args}
    return {
        variant(mode, decode): {**base, "dp_size": 1, "execution": mode, "decode": decode}
        for mode in MODES
        if not ctx.unsupported.get(mode)
        for decode in DECODES
    }


# --------------------------------------------------------------------------- served


@dataclass
class Matrix:
    """Each variant's row, and why each that failed did (it is measured no further)."""

    rows: dict[str, dict] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, ctx: Context) -> Matrix:
        """Rows for the variants this device cannot run, saying why; those whose mode
        failed in its tower section failed (not started)."""
        matrix, errors = cls(), ctx.mode_errors()
        for mode in MODES:
            why = ctx.unsupported.get(mode)
            for decode in DECODES:
                if why:
                    matrix.rows[variant(mode, decode)] = {"status": f"not possible here: {why}"}
                elif mode in errors:
                    matrix.fail(variant(mode, decode), f"not started: {errors[mode]}")
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


def section_switches(sec: Section, ctx: Context) -> None:
    plan, kinds, matrix = ctx.plan, windows(ctx), Matrix.of(ctx)
    names = matrix.serving(ctx.variant_apps)
    if not names:
        sec.record("variants", matrix.table())
        raise Skip("no variant to serve here (see variants)")
    run = ctx.served("proxy")
    denominators(sec, ctx)
    for name in names:
        try:
            run.needs(name)
        except SectionTimeout:
            raise
        except Exception as exc:  # noqa: BLE001 - recorded; the other variants go on
            matrix.fail(name, "not live", exc)
            continue
        start_variant(sec, ctx, run, name, matrix)
    per_window = plan.switch_warm_s + plan.switch_window_s + 1.0  # with the clients' start
    for label, bodies, clients, tower in kinds:
        for name in matrix.serving(names):
            if sec.fits(f"{name}, {label}", per_window):
                kind = (label, bodies, clients, tower)
                measure(sec, ctx, run, name, kind, matrix, inside=label == kinds[0][0])
    sec.record("execution after the windows", executions(run, matrix.serving(names)))
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
        "ready_s": run.live.get(name),
        "decode": ctx.variant_apps[name]["decode"],
        "decode_workers": procs.get("workers", 0),
    }


def measure(
    sec: Section, ctx: Context, run, name: str, kind: tuple, matrix: Matrix, inside: bool
) -> None:
    """One window of ``kind`` on the variant ``name``: its row, and its figures in the
    variant's row of the matrix (``inside``: also from inside the rank, for the first kind,
    8 images per request, the rank's batches full)."""
    label, bodies, clients, tower = kind
    try:
        row = window(ctx, run, name, bodies, clients, tower, ctx.plan.switch_load(clients))
    except SectionTimeout:
        raise
    except Exception as exc:  # noqa: BLE001 - recorded; the other variants go on
        matrix.fail(name, label, exc)
        return
    own = ctx.tower_by_mode().get(matrix.rows[name]["mode"], {}).get(f"{tower} images_per_s")
    if own:
        row["of_own_mode_tower"] = row["images_per_s"] / own
    sec.record(f"{name}, {label}", row)
    matrix.rows[name][f"{label} of_tower"] = row["of_tower"]
    if inside:
        rank = row["rank"]
        keys = ("forward_of_tower", "forward_wait_ms", "gpu_busy")
        matrix.rows[name] |= {key: rank.get(key) for key in keys}
