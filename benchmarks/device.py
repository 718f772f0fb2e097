"""What the device scripts share: the machine's versions, their options and the run of
their sections, the tower on a device, timing.

gpu_check.py and gpu_served.py run on the GPU machine from a plain checkout (no
install); ``--cpu-smoke`` runs them on CPU. This module imports only torch, numpy,
Pillow, ``kimi_encoder`` and ``benchmarks.common``.

Float32 settings are reported as torch's ``fp32_precision`` values, never through
the legacy ``allow_tf32`` flags: reading those after the library set the new ones
(a float32 model on CUDA asks for IEEE matmuls) raises.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import platform
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

import numpy as np
import PIL
import torch

from kimi_encoder import model as model_lib
from kimi_encoder.config import VisionConfig
from kimi_encoder.model import KimiVisionModel

from .common import Report, Section, say

Grid = tuple[int, int, int]
P = TypeVar("P")  # a script's plan
C = TypeVar("C")  # what a script's sections are given


H200_DATASHEET_TFLOPS = 989.0  # dense bf16


FLOP_FORMULA = (
    "per image of n = t*h*w patches, m = (h/2)*(w/2) merged tokens: 2*n*(3*p^2)*d (patch embed)"
    " + L*(2*n*d*3q (qkv) + 4*n^2*q (QK^T and PV) + 2*n*q*d (wo) + 4*n*d*f (MLP))"
    " + 2*m*(4d)^2 + 2*m*(4d)*T (projector); 2 FLOPs per multiply-add;"
    " k3: p=14, d=1024, q=1536, f=4096, L=27, T=7168"
)


# --- versions -------------------------------------------------------------------------


def versions() -> dict:
    """Python, torch, CUDA, Pillow and numpy versions, the host's cores, the float32
    settings, the attention kernels torch offers, and the GPU and its driver."""
    varlen = model_lib.varlen_function()
    out = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "pillow": PIL.__version__,
        "numpy": np.__version__,
        "cpu_threads": torch.get_num_threads(),
        "cores": os.cpu_count(),
        "fp32_precision": float32_settings(),
        "varlen_attn": "missing" if varlen is None else "present",
    }
    if varlen is not None:
        out["varlen_options"] = model_lib.varlen_options(varlen, 128)
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        out.update(
            gpu=props.name,
            sm_count=props.multi_processor_count,
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            capability=".".join(map(str, torch.cuda.get_device_capability(0))),
            driver=_driver_version(),
        )
    return out


def float32_settings() -> dict:
    """The process's float32 precision settings (``fp32_precision``; "none": torch's
    default, which the backend may still run as TF32)."""
    out = {}
    for name, owner in (
        ("matmul", torch.backends.cuda.matmul),
        ("cudnn_conv", getattr(torch.backends.cudnn, "conv", None)),
        ("global", torch.backends),
    ):
        value = getattr(owner, "fp32_precision", None) if owner is not None else None
        out[name] = value if value is not None else "n/a"
    return out


def _driver_version() -> str:
    """The driver's CUDA version as torch reports it, and the display driver from nvidia-smi."""
    parts = []
    with contextlib.suppress(Exception):  # a private call: absent or failing on some builds
        number = torch._C._cuda_getDriverVersion()
        parts.append(f"CUDA {number // 1000}.{number % 1000 // 10}")
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=5,
        )
        if smi.returncode == 0 and smi.stdout.strip():
            parts.append(smi.stdout.strip().splitlines()[0])
    return ", ".join(parts) or "unknown"


def versions_line(v: dict) -> str:
    gpu = "no CUDA"
    if "gpu" in v:
        gpu = (
            f"{v['gpu']} ({v['sm_count']} SMs, {v['gpu_memory_gib']} GiB, "
            f"sm {v['capability']}), driver {v['driver']}"
        )
    return (
        f"versions: python {v['python']}, torch {v['torch']}, CUDA {v['cuda']}, {gpu}, "
        f"Pillow {v['pillow']}, numpy {v['numpy']}, varlen_attn {v['varlen_attn']} "
        f"{v.get('varlen_options', '')}"
    )


def pillow_is_13() -> bool:
    return PIL.__version__.split(".")[0] == "13"


# --- a script's run -------------------------------------------------------------------


def script_arguments(doc: str, sections: Mapping, budget_s: float) -> argparse.ArgumentParser:
    """The options every device script takes: its output folder, its budget, --cpu-smoke and
    which of ``sections`` to run (all by default)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the reports")
    parser.add_argument("--budget-s", type=float, default=budget_s, help="whole run, seconds")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny preset on CPU (CI)")
    parser.add_argument("--sections", nargs="*", choices=list(sections), default=list(sections))
    return parser


def start_run(
    parser: argparse.ArgumentParser, argv: list[str] | None, full: P, smoke: P
) -> tuple[argparse.Namespace, P, dict]:
    """Parse ``argv``, print the versions line and refuse a GPU run without CUDA: the
    arguments, the plan (``smoke`` with --cpu-smoke, else ``full``) and the report's first
    data (versions, mode, preset)."""
    args = parser.parse_args(argv)
    info = versions()
    say(versions_line(info))
    if not args.cpu_smoke and not torch.cuda.is_available():
        parser.error("no CUDA device here; run with --cpu-smoke for the CPU variant")
    plan = smoke if args.cpu_smoke else full
    mode = "cpu-smoke" if args.cpu_smoke else "gpu"
    return args, plan, {"versions": info, "mode": mode, "preset": plan.preset}


def run_sections(
    report: Report,
    sections: Mapping[str, tuple[Callable[[Section, C], None], float]],
    names: Sequence[str],
    ctx: C,
    deadlines: Mapping[str, float],
) -> None:
    """Each of ``names`` in turn under its deadline (``Report.run``), given ``ctx``;
    ``sections`` maps a name to its function and the least seconds worth starting it.
    What a section left on the device is freed before the next; freeing it fails after a
    sticky CUDA error, which the section that hit it has recorded: the next sections still
    start, each recording its own error if the device is gone (gpu_served.py runs each
    section in a process of its own instead: benchmarks/isolated.py)."""
    for name in names:
        fn, min_s = sections[name]
        report.run(name, lambda sec, fn=fn: fn(sec, ctx), deadlines[name], min_s)
        gc.collect()
        if torch.cuda.is_available():
            with contextlib.suppress(Exception):
                torch.cuda.empty_cache()


class Rolling(Mapping[str, float]):
    """Deadlines of sections run in the order of ``shares`` (seconds of a run's budget
    each), read as each starts: its own share, or more where those before it ended early,
    since every section may run until the sum of the shares up to its own
    (``--sections`` chooses which count). The sections named in ``exact`` get their share
    alone, whatever those before them left."""

    def __init__(self, shares: Mapping[str, float], names: Sequence[str], exact=()):
        self.shares = {name: shares[name] for name in names}
        self.exact = set(exact)
        self.started = time.monotonic()

    def __getitem__(self, name: str) -> float:
        if name in self.exact:
            return self.shares[name]
        names = list(self.shares)
        upto = sum(self.shares[n] for n in names[: names.index(name) + 1])
        return max(self.shares[name], upto - (time.monotonic() - self.started))

    def __iter__(self):
        return iter(self.shares)

    def __len__(self) -> int:
        return len(self.shares)


# --- the tower on a device ------------------------------------------------------------


def preflight_varlen() -> dict:
    """One small varlen_attn call on the GPU, so a kernel that refuses its arguments on this
    machine shows up once, with its error, instead of failing every section."""
    if model_lib.Segments.of([(1, 2, 2)], torch.device("cuda"), torch.bfloat16, "auto").kernel != (
        "varlen"
    ):
        return {"varlen": "not chosen here (see versions)", "attention": "auto"}
    try:
        lengths = [5, 130]
        q, k, v = _random_qkv(lengths, torch.device("cuda"))
        out = model_lib.attend(q, k, v, _segments(lengths, torch.device("cuda"), "varlen"))
        torch.cuda.synchronize()
        assert out.shape == q.shape, f"varlen output shape {tuple(out.shape)}"
        assert torch.isfinite(out.float()).all(), "varlen output not finite"
        return {"varlen": "ok", "attention": "auto"}
    except Exception as exc:  # noqa: BLE001 - reported; the sections fall back to SDPA
        return {"varlen": f"failed: {type(exc).__name__}: {exc}", "attention": "sdpa"}


def _random_qkv(lengths, device, heads=12, head_dim=128, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    shape = (sum(lengths), heads, head_dim)
    return [torch.randn(shape, generator=gen, device=device).bfloat16() for _ in range(3)]


def _segments(lengths, device, kernel) -> model_lib.Segments:
    offsets, longest = model_lib.cumulative_lengths(lengths)
    cu = torch.tensor(offsets, dtype=torch.int32, device=device) if kernel == "varlen" else None
    return model_lib.Segments(list(lengths), longest, kernel, cu)


def device_random_model(cfg: VisionConfig, seed: int, device: str, dtype: torch.dtype):
    """Seeded random weights drawn on ``device`` itself: seconds for the full tower on a
    GPU. Same scales as ``weights.random_model`` (not the same values: that one draws on
    the host)."""
    with torch.device(device):
        model = KimiVisionModel(cfg)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen, device=device)
            if "norm" in name and name.endswith(".weight"):
                param.copy_(1.0 + 0.1 * noise)
            elif name.endswith(".bias"):
                param.copy_(0.02 * noise)
            elif name.endswith("pos_emb.weight"):
                param.copy_(0.1 * noise)
            else:
                param.copy_(noise / math.sqrt(max(1, math.prod(param.shape[1:]))))
    return model.to(dtype).eval()


def seeded_pixels(grids: Sequence[Grid], patch: int, device: str, seed: int = 0) -> torch.Tensor:
    rows = sum(t * h * w for t, h, w in grids)
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(rows, 3, patch, patch, generator=gen) * 2 - 1).to(device)


def tower_flops(cfg: VisionConfig, grids: Sequence[Grid]) -> float:
    """Matmul FLOPs of one forward over ``grids`` (FLOP_FORMULA)."""
    d, q, f, layers = cfg.hidden_size, cfg.qkv_hidden_size, cfg.intermediate_size, cfg.num_layers
    kh, kw = cfg.merge_kernel_size
    width = cfg.mm_hidden_size * cfg.merge_area
    total = 0.0
    for t, h, w in grids:
        n, tokens = t * h * w, (h // kh) * (w // kw)
        total += 2 * n * 3 * cfg.patch_size**2 * d
        total += layers * (2 * n * d * 3 * q + 4 * n * n * q + 2 * n * q * d + 4 * n * d * f)
        total += 2 * tokens * width * width + 2 * tokens * width * cfg.text_hidden_size
    return total


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(
    fn: Callable[[], object],
    device: str,
    seconds: float,
    warmup: int = 2,
    min_runs: int = 3,
    max_runs: int = 200,
) -> dict:
    """Median host enqueue time, device time (CUDA events) and wall time of ``fn``."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    host, gpu, wall = [], [], []
    started = time.perf_counter()
    while len(wall) < min_runs or (
        time.perf_counter() - started < seconds and len(wall) < max_runs
    ):
        if device == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            begin.record()
            fn()
            end.record()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            gpu.append(begin.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            t1 = t2 = time.perf_counter()
            gpu.append(t2 - t0)
        host.append(t1 - t0)
        wall.append(t2 - t0)
    return {
        "runs": len(wall),
        "host_enqueue_s": float(np.median(host)),
        "gpu_s": float(np.median(gpu)),
        "wall_s": float(np.median(wall)),
    }


def matmul_ceiling(n: int, device: str, seconds: float) -> dict:
    """bf16 (n x n) @ (n x n) TFLOP/s: what this device's dense matmul reaches."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    timing = measure(lambda: a @ b, device, seconds)
    out = {"n": n, **timing, "tflops": 2 * n**3 / timing["gpu_s"] / 1e12}
    if device == "cuda":
        out["of_datasheet_989"] = out["tflops"] / H200_DATASHEET_TFLOPS
    return out


def time_mix(net, cfg: VisionConfig, grids: Sequence[Grid], device: str, seconds: float) -> dict:
    pixels = seeded_pixels(grids, cfg.patch_size, device).to(torch.bfloat16)
    patches = sum(t * h * w for t, h, w in grids)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    with torch.inference_mode():
        timing = measure(lambda: net(pixels, grids), device, seconds)
    flops = tower_flops(cfg, grids)
    out = {
        "images": len(grids),
        "patches": patches,
        **timing,
        "patches_per_s": patches / timing["gpu_s"],
        "images_per_s": len(grids) / timing["gpu_s"],
        "tflop_per_forward": flops / 1e12,
        "tflops": flops / timing["gpu_s"] / 1e12,
    }
    if device == "cuda":
        out["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def kernel_breakdown(net, pixels, grids, top: int = 15) -> dict:
    """Device time of the costliest kernels of one forward (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode():
        net(pixels, grids)  # warm
        activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
        with profile(activities=activities) as prof:
            net(pixels, grids)
            torch.cuda.synchronize()

    def device_us(event) -> float:  # the attribute's name changed across torch versions
        value = getattr(event, "self_device_time_total", None)
        return value if value is not None else event.self_cuda_time_total

    events = sorted(prof.key_averages(), key=device_us, reverse=True)
    total = sum(device_us(e) for e in events) or 1.0
    return {
        e.key[:70]: {
            "calls": e.count,
            "device_ms": device_us(e) / 1e3,
            "share": device_us(e) / total,
        }
        for e in events[:top]
    }
