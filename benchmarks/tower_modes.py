"""The tower alone in each execution mode: the tower sections of benchmarks/gpu_served.py,
one mode each, each in a process of its own (benchmarks/isolated.py), so that a capture
that hangs or leaves the device unusable costs that mode alone.

- ``section_eager``: the served preset's tower (the weights ``VisionEncoder`` loads) in
  eager mode. First the reference features every app's answers are checked against, then
  the plan's FLOP batch (16 x 1024 patches on the GPU: TFLOP/s, the datasheet's share) and
  a batch of the square JPEGs and of the mixed set, each as large as a rank's batch; then
  the same with ``attention_kernel = "varlen"``, the kernel a graph always runs (eager
  picks cuDNN's SDPA for large images), so that graphs are also compared with eager on
  the same kernel.
- ``section_graphs``: captured for the buckets a rank captures (``default_buckets`` of
  its batch budget) and checked bucket by bucket against eager (``bucket_check``) before
  it is timed. Where graphs cannot run (CPU) the same check runs on the same buckets
  uncaptured. It comes before compiled: it is the fastest candidate on CUDA, and
  compiled's compilation is the step most likely to run out of time.
- ``section_compiled``: built under ``torch.inference_mode``, as the ranks build it (built
  outside it, inductor compiles again at the first call under it).

Each figure goes to the run's tower file as soon as it is measured (``Context.put_tower``),
and each section ends with the summary of every mode measured so far: ``tower by mode``,
and per set the fastest mode, the denominator of every later ratio.
"""

from __future__ import annotations

import math
import time

import torch

from benchmarks.common import Section
from benchmarks.device import H200_DATASHEET_TFLOPS, seeded_pixels, time_mix
from benchmarks.device_apps import MODES, SETS, Context, Plan
from benchmarks.inprocess import tower_only_rate
from kimi_encoder import model as model_lib
from kimi_encoder.encoder import VisionEncoder
from kimi_encoder.execution import (
    BucketRunner,
    Built,
    Execution,
    ExecutionConfig,
    build,
    default_buckets,
    graphs_unsupported,
)

Grid = tuple[int, int, int]
VARLEN = "eager, varlen"  # eager with the attention kernel a graph runs


def unsupported_here(device: str, dtype: str) -> dict[str, str | None]:
    """Why each mode (and eager on varlen) cannot run on ``device`` in ``dtype``, or None."""
    dt = getattr(torch, dtype)
    out: dict[str, str | None] = dict.fromkeys(MODES)
    out["graphs"] = graphs_unsupported(torch.device(device), dt)
    capability = torch.cuda.get_device_capability() if device == "cuda" else None
    why = model_lib.varlen_unsupported(device, dt, capability, model_lib.varlen_function())
    out[VARLEN] = f"attention_kernel 'varlen' {why}" if why else None
    return out


def execution_config(plan: Plan) -> ExecutionConfig:
    """A rank's: graphs for the buckets of its batch budget."""
    return ExecutionConfig(graph_buckets=default_buckets(plan.batch_patches))


def load(sec: Section, ctx: Context) -> VisionEncoder:
    plan = ctx.plan
    started = time.perf_counter()
    enc = VisionEncoder.from_pretrained(
        plan.preset, device=plan.device, dtype=plan.dtype, execution="eager"
    )
    built = {"preset": plan.preset, "dtype": plan.dtype, "backend": enc.backend}
    sec.record("encoder", {**built, "load_s": time.perf_counter() - started})
    return enc


# --------------------------------------------------------------------------- sections


def section_eager(sec: Section, ctx: Context) -> None:
    from benchmarks.device import float32_settings

    enc = load(sec, ctx)
    sec.record("fp32_precision", float32_settings())
    ctx.save_reference(enc)  # eager: what every app's answers are checked against
    ctx.put_tower("eager", {"status": "measuring", "build_s": 0.0})
    measure(sec, ctx, enc, "eager", enc.execution)
    why = ctx.unsupported.get(VARLEN)
    if why:
        ctx.put_tower(VARLEN, {"status": f"not possible here: {why}"})
    elif sec.fits(VARLEN, 8 * ctx.plan.timed_s):
        enc.model.vision_tower.attention_kernel = "varlen"
        ctx.put_tower(VARLEN, {"status": "measuring"})
        measure(sec, ctx, enc, VARLEN, enc.execution)
    summary(sec, ctx)


def section_graphs(sec: Section, ctx: Context) -> None:
    enc = load(sec, ctx)
    config = execution_config(ctx.plan)
    why = ctx.unsupported.get("graphs")
    if why:
        ctx.put_tower("graphs", {"status": f"not possible here: {why}"})
        sec.note(f"graphs cannot run here ({why}): the bucket check runs uncaptured")
        runner = BucketRunner(enc.model, config.graph_buckets, config.graph_max_images, False)
        bucket_check(sec, ctx, enc, runner)
    elif built := build_mode(sec, ctx, enc, "graphs", config):
        bucket_check(sec, ctx, enc, built.run)
        measure(sec, ctx, enc, "graphs", Execution("graphs", built.run, {"requested": "graphs"}))
        rows = ctx.tower_by_mode()
        for base in ("eager", VARLEN):
            ratios = {}
            for kind in SETS:
                key = f"{kind} images_per_s"
                graphs, other = rows["graphs"].get(key), rows.get(base, {}).get(key)
                ratios[f"{kind} set"] = graphs / other if graphs and other else None
            sec.record(f"graphs over {base}", ratios)
            if None in ratios.values():
                sec.note(f"graphs over {base}: no {base} figure for a set (its ratio left empty)")
    summary(sec, ctx)


def section_compiled(sec: Section, ctx: Context) -> None:
    enc = load(sec, ctx)
    built = build_mode(sec, ctx, enc, "compiled", execution_config(ctx.plan))
    if built:
        run = Execution("compiled", built.run, {"requested": "compiled"})
        measure(sec, ctx, enc, "compiled", run)
    summary(sec, ctx)


# --------------------------------------------------------------------------- measuring


def build_mode(sec: Section, ctx: Context, enc: VisionEncoder, mode: str, config) -> Built | None:
    """``mode`` built on ``enc``'s model under inference mode (as ``execution.prepare``
    builds it in a rank); a build that fails is recorded, and that mode is not served."""
    ctx.put_tower(mode, {"status": "building"})
    try:
        with torch.inference_mode():
            built = build(mode, enc.model, config)
    except Exception as exc:  # noqa: BLE001 - recorded: the mode's variants are not started
        error = f"{type(exc).__name__}: {str(exc)[:400]}"
        ctx.put_tower(mode, {"status": f"build failed: {error}", "error": error})
        sec.check(f"{mode} builds", False, error=error)
        return None
    ctx.put_tower(mode, {"status": "measuring", "build_s": built.build_s})
    sec.record(f"{mode} build_s", built.build_s)
    report = getattr(built.run, "report", None)  # compiled: its workers, cache hits, lock wait
    if isinstance(report, dict) and report:
        sec.record(f"{mode} build", report)
    return built


def measure(sec: Section, ctx: Context, enc: VisionEncoder, name: str, run: Execution) -> None:
    """The tower as ``run`` on the FLOP batch and on both sets, as large a batch as a
    rank's; each figure recorded and written to the tower file as it is measured."""
    plan = ctx.plan
    most = max(plan.per_request) * max(plan.clients)  # images in flight at most
    label, grids = plan.flops_mix
    enc.execution = run
    flops = time_mix(run.run, enc.vision, list(grids), plan.device, plan.timed_s)
    if plan.device == "cuda":
        flops["of_datasheet_989"] = flops["tflops"] / H200_DATASHEET_TFLOPS
    sec.record(f"{name}, {label}", flops)
    row = {f"{label} tflops": flops["tflops"], "of_datasheet_989": flops.get("of_datasheet_989")}
    ctx.put_tower(name, row)
    for kind, images in (("square", ctx.images), ("mixed", ctx.mixed)):
        measured = tower_only_rate(enc, images, plan.batch_patches, most, plan.timed_s)
        sec.record(f"{name}, {kind} set", measured)
        ctx.put_tower(name, {f"{kind} images_per_s": measured["images_per_s"]})
    ctx.put_tower(name, {"status": "ok"})


def summary(sec: Section, ctx: Context) -> None:
    """Every mode measured so far, and the fastest per set: every later ratio's denominator."""
    rows = ctx.tower_by_mode()
    sec.record("tower by mode", {mode: rows[mode] for mode in (*MODES, VARLEN) if mode in rows})
    for kind in SETS:
        mode, rate = ctx.tower(kind)
        sec.record(f"tower, {kind} set", {"mode": mode, "images_per_s": rate})


# --------------------------------------------------------------------------- buckets


def check_batches(bucket: int, previous: int, max_images: int) -> tuple[list[Grid], list[Grid]]:
    """A small and a large batch for ``bucket`` (``previous``: the patches of the next
    smaller bucket, 0 for the smallest): the small just over ``previous`` (a square image
    of at least ``previous`` patches and a 2x2 one), the large as near ``bucket`` as
    images 16 patches high make it.

    >>> check_batches(1024, 512, 64)
    ([(1, 24, 24), (1, 2, 2)], [(1, 16, 16), (1, 16, 16), (1, 16, 16), (1, 16, 16)])
    """
    small = [(1, 2, 2)]
    if previous:
        side = 2 * math.ceil(math.sqrt(previous) / 2)  # even, side * side >= previous
        small = [(1, side, side), (1, 2, 2)]
    count = max(1, min(max_images, bucket // 256))
    return small, [(1, 16, max(2, bucket // (16 * count) // 2 * 2))] * count


def bucket_check(sec: Section, ctx: Context, enc: VisionEncoder, runner: BucketRunner) -> None:
    """Per bucket, a small batch, a large one, then the small one again through
    ``runner``, each against eager: cosine >= 0.999, finite, the two small answers equal
    (nothing of the large batch left in the bucket's buffers), each batch in its bucket."""
    model, plan = enc.model, ctx.plan
    dtype = model.vision_tower.patch_embed.proj.weight.dtype
    rows, passed = {}, True
    previous = 0
    for bucket in runner.buckets:
        if not sec.fits(f"the bucket check from {bucket.patches} patches", 10):
            passed = False
            break
        small, large = check_batches(bucket.patches, previous, bucket.max_images)
        row: dict = {"small_patches": patches(small), "large_patches": patches(large)}
        answers, finite, placed = [], True, True
        with torch.inference_mode():
            batches = {}
            for seed, grids in enumerate((small, large)):
                pixels = seeded_pixels(grids, enc.vision.patch_size, plan.device, seed).to(dtype)
                batches[seed] = (grids, pixels, model(pixels, grids).float())
            for label, seed in (("small", 0), ("large", 1), ("small again", 0)):
                grids, pixels, eager = batches[seed]
                placed &= runner.pick(patches(grids), len(grids)) is bucket
                got = runner(pixels, grids).float()
                finite &= bool(torch.isfinite(got).all())
                row[f"{label} cosine"] = cosine(got, eager)
                answers.append(got)
        row |= {"finite": finite, "in_its_bucket": placed}
        row["small_equal"] = bool(torch.equal(answers[0], answers[2]))
        cosines = [row[f"{label} cosine"] for label in ("small", "large", "small again")]
        passed &= finite and placed and row["small_equal"] and min(cosines) >= 0.999
        rows[f"bucket {bucket.patches}"] = row
        previous = bucket.patches
        sec.record("graphs vs eager, small-large-small", rows)
    captured = "captured" if runner.capture else "uncaptured"
    sec.check(f"every bucket ({captured}) matches eager: small, large, small again", passed)
    sec.record("buckets after the check", runner.info())


def patches(grids: list[Grid]) -> int:
    return sum(t * h * w for t, h, w in grids)


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.cosine_similarity(a.flatten(), b.flatten(), dim=0))
