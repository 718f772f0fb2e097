"""One-GPU check: the CUDA tests, tower throughput, preprocessing and the batcher's rate.

Run from the repository root on the GPU machine (no network needed), Pillow as installed:

    PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py --out "$OUT" --budget-s 420

The cpu backend is bit-exact to Pillow 13 only. To compare against Pillow 13 where the
machine has another version, carry its wheel in the working tree, untracked (fetched on a
machine with network: ``pip download 'pillow>=13,<14' --only-binary=:all: --no-deps
--python-version 3.12 --platform manylinux_2_28_x86_64 -d wheels/``), and run (a wheel is a
zip: no pip, no network needed there):

    python3 -m zipfile -e wheels/pillow-13*.whl /tmp/pil13 && PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/pil13 python3 benchmarks/gpu_check.py --out "$OUT" --budget-s 420

CI runs every section on CPU with the tiny preset in seconds (the CUDA tests report
"skipped: no CUDA"):

    python benchmarks/gpu_check.py --cpu-smoke --out /tmp/gc

Sections, each under its own deadline within the run's budget (``common.Report``):

- correctness: ``pytest -m cuda`` over the test files holding CUDA tests (the checks
  of the float32, bfloat16, batch-invariance, attention-kernel and preprocessing
  paths live there, tests/kimi_encoder/test_cuda_checks.py among them); its log goes to
  ``pytest_cuda.txt``;
- tower: the bf16 matmul ceiling, then the tower's TFLOP/s on batch mixes;
- preprocess: decode + preprocess, both backends, one image per call;
- served: the rank's batcher in-process (benchmarks/inprocess.py), its tower in the mode
  ``--execution`` pins (eager by default; gpu_served.py compares the modes).

The float32 settings are the library's and the process's own (reported as
``fp32_precision``): this script sets none. Writes ``gpu_check.json`` and
``gpu_check.md`` into ``--out`` after every measurement. Exit status 1 when a check
fails or a section errors. Imports only ``kimi_encoder`` and, for the served section,
``deployments.batcher``, whose settings are pydantic models: where pydantic does not
import, the Ray site carried with the tree is unpacked first (``served.carried_site``).
"""  # noqa: E501 (the commands stay one line each, to paste)

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import PIL
import torch

if __name__ == "__main__" and not __package__:  # run as a script: see benchmarks/checkout.py
    from checkout import import_from_checkout

    import_from_checkout()

from benchmarks.checkout import ROOT, pythonpath
from benchmarks.common import Report, Section, say
from benchmarks.device import (
    FLOP_FORMULA,
    Grid,
    device_random_model,
    float32_settings,
    kernel_breakdown,
    matmul_ceiling,
    measure,
    pillow_is_13,
    preflight_varlen,
    run_sections,
    script_arguments,
    seeded_pixels,
    start_run,
    synchronize,
    time_mix,
    versions_line,
)
from benchmarks.inprocess import batcher_section
from benchmarks.inputs import encoded, photo
from kimi_encoder import model as model_lib
from kimi_encoder.config import PreprocessConfig, VisionConfig, get_preset
from kimi_encoder.items import plan_image
from kimi_encoder.preprocess import preprocess


@dataclass(frozen=True)
class Plan:
    """What the sections run: full sizes on the GPU, or --cpu-smoke's tiny ones on CPU."""

    device: str
    preset: str
    mixes: dict[str, list[Grid]]  # tower throughput batches
    matmul_n: int  # side of the square bf16 matmul ceiling
    timed_s: float  # measuring time per throughput row
    preprocess_sizes: dict[str, tuple[int, int]]
    resize_patch_limit: int  # in_patch_limit that makes the largest preprocess size resize
    served_sizes: tuple[tuple[int, int], ...]
    concurrencies: tuple[int, ...]
    served_s: float  # measuring time per concurrency
    deadlines: dict[str, float]  # seconds per section


def _mixed(*parts: tuple[int, Grid]) -> list[Grid]:
    return [grid for count, grid in parts for _ in range(count)]


FULL = Plan(
    device="cuda",
    preset="k3",
    mixes={
        "16 x 1024": _mixed((16, (1, 32, 32))),
        "64 x 256": _mixed((64, (1, 16, 16))),
        "4 x 4096": _mixed((4, (1, 64, 64))),
        "1 x 16384": _mixed((1, (1, 128, 128))),
        "mixed 15 images": _mixed(
            (1, (1, 78, 138)), (2, (1, 32, 32)), (4, (1, 16, 16)), (8, (1, 8, 8))
        ),
    },
    matmul_n=8192,
    timed_s=3.0,
    preprocess_sizes={"448x448": (448, 448), "1920x1080": (1920, 1080), "12 MP": (4000, 3000)},
    resize_patch_limit=16384,  # Kimi-K2.5's: 12 MP -> about 1800 x 1350
    served_sizes=((448, 448), (448, 336), (336, 448), (512, 384)),
    concurrencies=(8, 32),
    served_s=12.0,
    deadlines={"correctness": 150, "tower": 75, "preprocess": 70, "served": 80},
)

SMOKE = Plan(
    device="cpu",
    preset="tiny",
    mixes={"4 x 64": _mixed((4, (1, 8, 8))), "mixed 3 images": [(1, 4, 6), (1, 8, 8), (1, 2, 2)]},
    matmul_n=256,
    timed_s=0.2,
    preprocess_sizes={"64x48": (64, 48), "200x120": (200, 120)},
    resize_patch_limit=64,
    served_sizes=((64, 48), (56, 56)),
    concurrencies=(2, 4),
    served_s=0.5,
    deadlines={"correctness": 40, "tower": 20, "preprocess": 20, "served": 30},
)


@dataclass
class Context:
    """What every section gets: the plan, the output folder and the attention kernel to use
    (``sdpa`` when the varlen preflight failed, so the throughput sections still run)."""

    plan: Plan
    out: Path
    attention: str = "auto"
    decode_threads: int = 2
    execution: str = "eager"  # the served rank's tower mode, pinned: gpu_served compares them
    preflight: dict = field(default_factory=dict)

    def model(self, cfg: VisionConfig, dtype: torch.dtype):
        net = device_random_model(cfg, seed=0, device=self.plan.device, dtype=dtype)
        net.vision_tower.attention_kernel = self.attention
        return net


# --------------------------------------------------------------------------- correctness


def section_correctness(sec: Section, ctx: Context) -> None:
    if ctx.plan.device != "cuda":
        sec.check("pytest -m cuda", None, reason="skipped: no CUDA")
        return
    tests = CudaTests.start(sec, ctx.out)
    try:
        tests.finish(sec)
    finally:  # an error or the section's alarm: leave no test process behind
        tests.stop()


@dataclass
class CudaTests:
    """``pytest -m cuda`` over the Ray-free test files holding CUDA tests, in a subprocess;
    its whole log goes to ``pytest_cuda.txt``."""

    process: subprocess.Popen
    log: Path
    files: list[str]
    started: float

    @classmethod
    def start(cls, sec: Section, out: Path) -> CudaTests:
        files = sorted(
            str(p.relative_to(ROOT))
            for p in (ROOT / "tests").glob("test_*.py")
            if "mark.cuda" in p.read_text()
        )
        command = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-rfE"]
        command += ["-p", "no:cacheprovider", *files]
        out.mkdir(parents=True, exist_ok=True)
        log = out / "pytest_cuda.txt"
        env = {**os.environ, "PYTHONPATH": pythonpath(), "PYTHONUNBUFFERED": "1"}
        with open(log, "w") as sink:
            process = subprocess.Popen(
                command, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT
            )
        sec.note(f"pytest -m cuda started on {len(files)} files")
        return cls(process, log, files, time.monotonic())

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def finish(self, sec: Section) -> None:
        """Wait for the tests within the section's deadline (killed past it), then record."""
        try:
            self.process.wait(timeout=max(1.0, sec.left() - 5))
        except subprocess.TimeoutExpired:
            self.stop()
            tail = self.log.read_text(errors="replace")[-2000:]
            seconds = time.monotonic() - self.started
            reason = f"incomplete: still running after {seconds:.0f} s (section deadline)"
            sec.check("pytest -m cuda", None, reason=reason, tail=tail)
            return
        lines = self.log.read_text(errors="replace").strip().splitlines()
        failed = [ln.split(" - ")[0] for ln in lines if ln.startswith(("FAILED", "ERROR"))]
        detail = {
            "files": self.files,
            "summary": lines[-1] if lines else "(no output)",
            "failed": failed[:30],
            "rc": self.process.returncode,
            "seconds": time.monotonic() - self.started,
        }
        # The ported preprocessing follows Pillow 13: other versions may differ there only.
        pillow_tests = r"test_(pil_ops|backends)\.py|test_cuda_checks\.py::test_backends"
        pillow_only = failed and all(re.search(pillow_tests, f) for f in failed)
        if self.process.returncode == 0:
            sec.check("pytest -m cuda", True, **detail)
        elif pillow_only and not pillow_is_13():
            sec.check(
                "pytest -m cuda", None, reason=f"Pillow differs ({PIL.__version__})", **detail
            )
        else:
            sec.check("pytest -m cuda", False, tail="\n".join(lines[-40:]), **detail)


# --------------------------------------------------------------------------- tower


def section_tower(sec: Section, ctx: Context) -> None:
    plan = ctx.plan
    cfg = get_preset(plan.preset).vision
    device, dtype = plan.device, torch.bfloat16
    sec.record("fp32_precision", float32_settings())
    sec.record("matmul_ceiling", matmul_ceiling(plan.matmul_n, device, plan.timed_s / 2))
    started = time.perf_counter()
    net = ctx.model(cfg, dtype)
    sec.record("weights_built_s", time.perf_counter() - started)
    sec.record("attention", ctx.attention)

    def kernel_of(grids) -> str:  # what the tower runs for this batch (auto: by image size)
        return model_lib.Segments.of(grids, torch.device(device), dtype, ctx.attention).kernel

    for name, grids in plan.mixes.items():
        if not sec.fits(f"mix {name}", 4 * plan.timed_s):
            return
        timing = time_mix(net, cfg, grids, device, plan.timed_s)
        sec.record(f"mix {name} ({kernel_of(grids)})", timing)
    mixed = list(plan.mixes)[-1]
    kernel = kernel_of(plan.mixes[mixed])
    other = "sdpa" if kernel == "varlen" else "varlen"
    if device == "cuda" and sec.fits(f"mixed batch with {other}", 4 * plan.timed_s):
        net.vision_tower.attention_kernel = other
        timing = time_mix(net, cfg, plan.mixes[mixed], device, plan.timed_s)
        net.vision_tower.attention_kernel = ctx.attention
        sec.record(f"mix {mixed} ({other})", timing)
    if device == "cuda" and sec.fits("kernel breakdown", 10):
        pixels = seeded_pixels(plan.mixes[mixed], cfg.patch_size, device).to(dtype)
        try:
            breakdown = kernel_breakdown(net, pixels, plan.mixes[mixed])
            sec.record(f"top kernels, mix {mixed} ({kernel})", breakdown)
        except Exception as exc:  # noqa: BLE001 - the profiler is an extra, not a check
            sec.note(f"kernel breakdown failed: {type(exc).__name__}: {exc}")


# --------------------------------------------------------------------------- preprocess


def section_preprocess(sec: Section, ctx: Context) -> None:
    """Images/s of decode + resize + normalize + patchify, both backends, one at a time.

    K3's limits keep these sizes (they only pad), so the largest size also runs with a
    patch limit that makes it resize.
    """
    plan = ctx.plan
    k3 = PreprocessConfig()
    resizing = replace(k3, in_patch_limit=plan.resize_patch_limit)
    sec.record(
        "method",
        "one image per call: decode (host) + preprocess, synchronized; "
        f"the gpu backend on {plan.device}; torch threads {torch.get_num_threads()}",
    )
    largest = list(plan.preprocess_sizes)[-1]
    for size_name, (w, h) in plan.preprocess_sizes.items():
        img = photo(w, h, seed=w + h)
        configs = {"k3 limits": k3}
        if size_name == largest:
            configs[f"limit {plan.resize_patch_limit} patches"] = resizing
        for fmt in ("JPEG", "PNG"):
            data = encoded(img, fmt)
            for config_name, cfg in configs.items():
                if not sec.fits(f"{size_name} {fmt}", plan.timed_s * 2):
                    return
                row = preprocess_rates(data, cfg, plan)
                sec.record(f"{size_name} {fmt} ({config_name})", row)


def preprocess_rates(data: bytes, cfg: PreprocessConfig, plan: Plan) -> dict:
    device = torch.device(plan.device)
    row: dict = {"bytes": len(data)}
    for backend in ("cpu", "gpu"):
        item = plan_image(data, cfg, backend)
        resize = item.deferred.resize_config
        row.update(grid=list(item.grid), resized_to=[resize.new_width, resize.new_height])

        def run(item=item):
            preprocess(data, item.deferred, 14, device)
            synchronize(plan.device)

        timing = measure(run, "cpu", plan.timed_s / 2, warmup=1, min_runs=2)
        row[f"{backend}_images_per_s"] = 1 / timing["wall_s"]
    return row


# --------------------------------------------------------------------------- served


def section_served(sec: Section, ctx: Context) -> None:
    """dp 1 on one device: closed-loop clients through the rank's RankBatcher, in-process."""
    if importlib.util.find_spec("pydantic") is None:
        from benchmarks.served import BUNDLE, carried_site

        sec.record("site", carried_site(BUNDLE, Path(tempfile.gettempdir()) / "kimi-encoder-site"))
    plan = ctx.plan
    preset = get_preset(plan.preset)
    images = [encoded(photo(w, h, seed=i), "JPEG") for i, (w, h) in enumerate(plan.served_sizes)]
    net = ctx.model(preset.vision, torch.bfloat16)
    name = f"preset:{plan.preset}"
    args = (images, plan.concurrencies, plan.served_s, plan.timed_s, ctx.decode_threads)
    batcher_section(sec, net, preset, name, *args, execution=ctx.execution)


# --------------------------------------------------------------------------- main

# name -> (function, least seconds worth starting)
SECTIONS: dict[str, tuple[Callable[[Section, Context], None], float]] = {
    "correctness": (section_correctness, 30),
    "tower": (section_tower, 20),
    "preprocess": (section_preprocess, 15),
    "served": (section_served, 25),
}


def intro(data: dict) -> list[str]:
    return [
        versions_line(data["versions"]),
        "",
        f"preflight: {data.get('preflight', 'n/a')}",
        "",
        f"FLOPs: {data['flop_formula']}",
        "",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = script_arguments(__doc__, SECTIONS, budget_s=420.0)
    parser.add_argument(
        "--decode-threads", type=int, default=2, help="the served rank's decode threads"
    )
    parser.add_argument(
        "--attention",
        choices=("auto", "varlen", "sdpa"),
        default="auto",
        help="attention kernel of the throughput sections (auto: the model's own choice)",
    )
    parser.add_argument(
        "--execution",
        choices=("eager", "compiled", "graphs"),
        default="eager",
        help="the served rank's tower mode (pinned: 'auto' would measure whichever won)",
    )
    args, plan, data = start_run(parser, argv, FULL, SMOKE)
    data["flop_formula"] = FLOP_FORMULA
    title = f"GPU check ({data['mode']}, preset {plan.preset})"
    report = Report(args.out, "gpu_check", title, data, args.budget_s, intro)
    ctx = Context(plan, args.out, decode_threads=args.decode_threads, execution=args.execution)
    if plan.device == "cuda":
        ctx.preflight = report.data["preflight"] = preflight_varlen()
        ctx.attention = ctx.preflight["attention"]
        say(f"preflight: {ctx.preflight}")
    if args.attention != "auto":
        ctx.attention = report.data["attention"] = args.attention
    report.write()
    run_sections(report, SECTIONS, args.sections, ctx, plan.deadlines)
    say(f"wrote {args.out / 'gpu_check.json'} and gpu_check.md; exit code {report.exit_code()}")
    return report.exit_code()


if __name__ == "__main__":
    sys.exit(main())
