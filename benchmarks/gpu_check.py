"""One-GPU check: correctness, tower throughput, preprocessing and the served rate.

Run from the repository root on the GPU machine (no network needed), Pillow as installed:

    PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py --out "$OUT" --budget-s 420

The cpu backend is bit-exact to Pillow 13 only. To compare against Pillow 13 where the
machine has another version, carry its wheel (about 5 MB) in the working tree, untracked
(fetched on a machine with network: ``pip download 'pillow>=13,<14' --only-binary=:all:
--no-deps --python-version 3.12 --platform manylinux_2_28_x86_64 -d wheels/``), and run
(a wheel is a zip: no pip, no network needed there):

    python3 -m zipfile -e wheels/pillow-13*.whl /tmp/pil13 && PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/pil13 python3 benchmarks/gpu_check.py --out "$OUT" --budget-s 420

CI runs every section on CPU with the tiny preset in seconds (CUDA-only checks report
"skipped: no CUDA"):

    python benchmarks/gpu_check.py --cpu-smoke --out /tmp/gc

Writes ``gpu_check.json`` and ``gpu_check.md`` into ``--out`` after every measurement, so
a run killed midway keeps what it measured (and ``pytest_cuda.txt``, the CUDA tests' log).
Each section has a deadline and the whole run a budget; a section that no longer fits is
skipped, saying so. The first line printed names the versions. Exit status 1 when a correctness check fails or a section errors.
Imports only ``kimi_encoder`` and, for the served section, ``deployments.batcher``.
"""  # noqa: E501 (the commands stay one line each, to paste)

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import functools
import gc
import importlib.util
import io
import json
import math
import os
import platform
import re
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import PIL
import torch
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script: the library is imported from this checkout

from kimi_encoder import model as model_lib  # noqa: E402
from kimi_encoder.config import PreprocessConfig, VisionConfig, get_preset  # noqa: E402
from kimi_encoder.encoder import VisionEncoder  # noqa: E402
from kimi_encoder.items import plan_image  # noqa: E402
from kimi_encoder.model import KimiVisionModel  # noqa: E402
from kimi_encoder.preprocess import preprocess  # noqa: E402

Grid = tuple[int, int, int]
say = functools.partial(print, flush=True)  # progress lines arrive even without PYTHONUNBUFFERED
H200_DATASHEET_TFLOPS = 989.0  # dense bf16
FLOP_FORMULA = (
    "per image of n = t*h*w patches, m = (h/2)*(w/2) merged tokens: 2*n*(3*p^2)*d (patch embed)"
    " + L*(2*n*d*3q (qkv) + 4*n^2*q (QK^T and PV) + 2*n*q*d (wo) + 4*n*d*f (MLP))"
    " + 2*m*(4d)^2 + 2*m*(4d)*T (projector); 2 FLOPs per multiply-add;"
    " k3: p=14, d=1024, q=1536, f=4096, L=27, T=7168"
)


# --------------------------------------------------------------------------- plan


@dataclass(frozen=True)
class Plan:
    """What the sections run: full sizes on the GPU, or --cpu-smoke's tiny ones on CPU."""

    device: str
    preset: str
    check_grids: tuple[Grid, ...]  # images of the model checks
    mixes: dict[str, list[Grid]]  # tower throughput batches
    matmul_n: int  # side of the square bf16 matmul ceiling
    timed_s: float  # measuring time per throughput row
    backend_sizes: tuple[tuple[int, int], ...]  # (w, h) of the backend comparison
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
    check_grids=((1, 8, 8), (1, 16, 24), (1, 32, 32)),
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
    backend_sizes=((90, 50), (900, 700), (333, 47), (1, 1), (1203, 901)),
    preprocess_sizes={"448x448": (448, 448), "1920x1080": (1920, 1080), "12 MP": (4000, 3000)},
    resize_patch_limit=16384,  # Kimi-K2.5's: 12 MP -> about 1800 x 1350
    served_sizes=((448, 448), (448, 336), (336, 448), (512, 384)),
    concurrencies=(8, 32),
    served_s=12.0,
    deadlines={"correctness": 170, "tower": 75, "preprocess": 70, "served": 80},
)

SMOKE = Plan(
    device="cpu",
    preset="tiny",
    check_grids=((1, 2, 2), (1, 4, 6), (1, 8, 8)),
    mixes={"4 x 64": _mixed((4, (1, 8, 8))), "mixed 3 images": [(1, 4, 6), (1, 8, 8), (1, 2, 2)]},
    matmul_n=256,
    timed_s=0.2,
    backend_sizes=((90, 50), (333, 47), (1, 1)),
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
    preflight: dict = field(default_factory=dict)

    def model(self, cfg: VisionConfig, dtype: torch.dtype, device: str | None = None):
        net = device_random_model(cfg, seed=0, device=device or self.plan.device, dtype=dtype)
        net.vision_tower.attention_kernel = self.attention
        return net


# --------------------------------------------------------------------------- harness


class SectionTimeout(Exception):
    pass


@dataclass
class Section:
    """One section's record; ``results`` fills as it runs, so a timeout keeps them."""

    name: str
    deadline_s: float
    status: str = "running"
    elapsed_s: float = 0.0
    checks: list[dict] = field(default_factory=list)
    results: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    error: str | None = None
    _started: float = field(default_factory=time.monotonic)
    _save: Callable[[Section], None] | None = None  # writes the report after each entry

    def left(self) -> float:
        return self.deadline_s - (time.monotonic() - self._started)

    def fits(self, what: str, needs_s: float) -> bool:
        """Whether ``what`` (about ``needs_s`` seconds) still fits the deadline; notes a skip."""
        if self.left() >= needs_s:
            return True
        self.notes.append(f"skipped {what}: {self.left():.0f} s left of the section's deadline")
        return False

    def check(self, name: str, passed: bool | None, **detail) -> None:
        """A pass/fail check (``passed`` None: skipped, with ``reason`` in ``detail``)."""
        status = "skipped" if passed is None else ("pass" if passed else "fail")
        self.checks.append({"name": name, "status": status, **detail})
        say(f"  [{status}] {name} {_brief(detail)}")
        self._saved()

    def record(self, key: str, value) -> None:
        self.results[key] = value
        say(f"  {key}: {_brief(value)}")
        self._saved()

    def _saved(self) -> None:
        if self._save is not None:
            self._save(self)

    def as_dict(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if not k.startswith("_")}
        return _rounded(out)


class Report:
    """The run's record, written to ``--out`` as JSON and Markdown after every section."""

    def __init__(self, out: Path, versions: dict, plan: Plan, smoke: bool, budget_s: float):
        self.out = out
        self.started = time.monotonic()
        self.budget_s = budget_s
        self.data = {
            "versions": versions,
            "mode": "cpu-smoke" if smoke else "gpu",
            "preset": plan.preset,
            "budget_s": budget_s,
            "flop_formula": FLOP_FORMULA,
            "sections": {},
        }

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)

    def save_section(self, section: Section) -> None:
        self.data["sections"][section.name] = section.as_dict()
        self.write()

    def write(self) -> None:
        self.data["elapsed_s"] = round(time.monotonic() - self.started, 1)
        self.data["exit_code"] = self.exit_code()
        self.out.mkdir(parents=True, exist_ok=True)
        for name, text in (
            ("gpu_check.json", json.dumps(self.data, indent=2)),
            ("gpu_check.md", markdown(self.data)),
        ):
            tmp = self.out / f".{name}.tmp"
            tmp.write_text(text + "\n")
            tmp.replace(self.out / name)

    def exit_code(self) -> int:
        for section in self.data["sections"].values():
            if section["status"] in ("fail", "error"):
                return 1
        return 0


@contextlib.contextmanager
def alarm(seconds: float) -> Iterator[None]:
    """Raise SectionTimeout in the main thread after ``seconds`` (a backstop: sections
    also check their deadline between steps; a running CUDA call finishes first)."""

    def fire(signum, frame):
        raise SectionTimeout(f"deadline of {seconds:.0f} s passed")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


RESERVE_S = 10.0  # left at the end of the budget for writing and exiting
GRACE_S = 15.0  # past a section's deadline before the alarm interrupts it


def run_section(
    report: Report, name: str, fn: Callable[[Section, Context], None], ctx: Context, min_s: float
) -> None:
    deadline_s = ctx.plan.deadlines[name]
    left = report.left() - RESERVE_S
    section = Section(name, deadline_s=min(deadline_s, left), _save=report.save_section)
    report.save_section(section)
    say(f"== {name} (deadline {section.deadline_s:.0f} s, budget left {report.left():.0f} s)")
    if left < min_s:
        section.status = f"skipped: {left:.0f} s of the budget left, the section needs {min_s:.0f}"
        say(f"  {section.status}")
    else:
        try:
            with alarm(section.deadline_s + GRACE_S):
                fn(section, ctx)
            failed = any(c["status"] == "fail" for c in section.checks)
            section.status = "fail" if failed else "pass"
        except SectionTimeout as exc:
            section.status = "timeout"
            section.error = str(exc)
        except Exception as exc:  # noqa: BLE001 - recorded; the next sections still run
            section.status = "error"
            section.error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=8)}"
            say(section.error)
    section.elapsed_s = section.deadline_s - section.left()
    report.save_section(section)
    say(f"== {name}: {section.status} in {section.elapsed_s:.1f} s")
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------- versions


def versions() -> dict:
    out = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "pillow": PIL.__version__,
        "numpy": np.__version__,
        "cpu_threads": torch.get_num_threads(),
        "varlen_attn": "missing" if model_lib.varlen_attn is None else "present",
    }
    if model_lib.varlen_attn is not None:
        out["varlen_options"] = model_lib.varlen_options(model_lib.varlen_attn, 128)
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


def pillow_is_13() -> bool:
    return PIL.__version__.split(".")[0] == "13"


# --------------------------------------------------------------------------- images


def _test_images():
    """``tests/images.py`` (every PIL mode, seeded), or None where it cannot be imported."""
    path = ROOT / "tests" / "images.py"
    try:
        spec = importlib.util.spec_from_file_location("kimi_test_images", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    except Exception:  # noqa: BLE001 - fall back to our own generator
        return None


def photo(width: int, height: int, seed: int) -> Image.Image:
    """A seeded photo-like RGB image: smooth gradients, a hard edge, mild noise."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    fx, fy = xx / max(width - 1, 1), yy / max(height - 1, 1)
    base = np.stack([fx, fy, 0.5 + 0.5 * np.sin(6 * (fx + fy))], axis=-1)
    base[..., 1] = np.where(fx > 0.6, 1 - base[..., 1], base[..., 1])
    noise = rng.normal(0, 0.03, size=(height, width, 1)).astype(np.float32)
    return Image.fromarray(np.clip((base + noise) * 255, 0, 255).astype(np.uint8), "RGB")


def encoded(img: Image.Image, fmt: str) -> bytes:
    out = io.BytesIO()
    options = {"quality": 90} if fmt == "JPEG" else {"compress_level": 1}
    img.save(out, format=fmt, **options)
    return out.getvalue()


def backend_cases(sizes) -> Iterator[tuple[str, bytes, Image.Image | None]]:
    """(name, file bytes, in-memory image or None) in every mode the encoder must take."""
    images = _test_images()
    if images is None:  # own seeded images in the common modes
        for mode in ("RGB", "RGBA", "L", "LA", "P", "CMYK", "1", "I", "F", "YCbCr"):
            for w, h in sizes:
                img = photo(w, h, seed=w).convert(mode)
                fmt = "TIFF" if mode in ("CMYK", "I", "F", "YCbCr") else "PNG"
                yield f"{mode} {w}x{h}", encoded_as(img, fmt), None
        return
    for mode in images.MODES + getattr(images, "RARE_FILE_MODES", ()):
        for w, h in sizes:
            yield f"{mode} {w}x{h}", images.image_bytes(mode, (w, h), seed=5), None
    for mode in getattr(images, "MEMORY_MODES", ()):
        if mode == "La":  # Pillow cannot convert it to RGB (both backends raise)
            continue
        for w, h in sizes:
            rgb = images.image_bytes("RGB", (w, h))
            yield f"{mode} {w}x{h} (in memory)", rgb, images.make_image(mode, (w, h), seed=5)


def encoded_as(img: Image.Image, fmt: str) -> bytes:
    out = io.BytesIO()
    img.save(out, format=fmt)
    return out.getvalue()


# --------------------------------------------------------------------------- models


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


def compare(got: torch.Tensor, want: torch.Tensor) -> dict:
    """Max abs difference, relative L2 and cosine of two feature tensors (as float64)."""
    a, b = got.detach().double().cpu().flatten(), want.detach().double().cpu().flatten()
    return {
        "max_abs": float((a - b).abs().max()),
        "rel_l2": float((a - b).norm() / b.norm().clamp_min(1e-30)),
        "cosine": float(torch.nn.functional.cosine_similarity(a, b, dim=0)),
        "bitwise": bool(torch.equal(got.cpu(), want.cpu())),
    }


def split_features(model, pixels, grids) -> list[torch.Tensor]:
    with torch.inference_mode():
        features = model(pixels, grids)
    kh, kw = model.cfg.merge_kernel_size
    return list(features.split([(h // kh) * (w // kw) for _, h, w in grids]))


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# --------------------------------------------------------------------------- correctness


def section_correctness(sec: Section, ctx: Context) -> None:
    plan = ctx.plan
    tests = CudaTests.start(sec, ctx.out) if plan.device == "cuda" else None
    try:  # the tests run in a subprocess while the checks below run here
        check_backends(sec, plan)
        if sec.fits("model checks", 20):
            with fp32_exact():
                model_checks(sec, ctx)
    except BaseException:  # an error or the section's alarm: leave no test process behind
        if tests is not None:
            tests.stop()
        raise
    if tests is None:
        sec.check("pytest -m cuda", None, reason="skipped: no CUDA")
    else:
        tests.finish(sec)


def model_checks(sec: Section, ctx: Context) -> None:
    plan = ctx.plan
    cfg = get_preset(plan.preset).vision
    grids = list(plan.check_grids)
    pixels = seeded_pixels(grids, cfg.patch_size, plan.device)
    # Drawn on the device (seconds for the full tower); the CPU copy holds the same values.
    fp32 = ctx.model(cfg, torch.float32)
    if plan.device == "cuda":
        check_fp32_cuda_vs_cpu(sec, fp32, pixels, grids)
    else:
        sec.check("float32 CUDA vs CPU", None, reason="skipped: no CUDA")
    low = copy.deepcopy(fp32).to(torch.bfloat16)
    check_bf16_drift(sec, fp32, low, pixels, grids)
    del fp32
    check_batch_invariance(sec, low, pixels, grids)
    if plan.device == "cuda":
        check_varlen_vs_sdpa(sec, ctx, low, pixels, grids)
    else:
        sec.check("varlen vs per-image SDPA", None, reason="skipped: no CUDA")


def check_backends(sec: Section, plan: Plan) -> None:
    """gpu backend (on the plan's device) vs cpu backend (PIL), pixel for pixel."""
    configs = {"tiny limits": get_preset("tiny").preprocess, "k3 limits": PreprocessConfig()}
    device = torch.device(plan.device)
    same, differ, errors = 0, [], []
    for config_name, cfg in configs.items():
        for name, data, image in backend_cases(plan.backend_sizes):
            try:
                pixels = {}
                for backend in ("cpu", "gpu"):
                    item = plan_image(data, cfg, backend)
                    source = item.image if image is None else image
                    pixels[backend], _ = preprocess(source, item.deferred, 14, device)
                if torch.equal(pixels["cpu"].cpu(), pixels["gpu"].cpu()):
                    same += 1
                else:
                    diff = (pixels["cpu"].cpu() - pixels["gpu"].cpu()).abs().max().item()
                    differ.append(f"{name} ({config_name}): max diff {diff:.3g}")
            except Exception as exc:  # noqa: BLE001 - one case fails alone
                errors.append(f"{name} ({config_name}): {type(exc).__name__}: {exc}")
        if sec.left() < 10:
            sec.notes.append(f"backend comparison stopped after {config_name}: deadline")
            break
    detail = {
        "device": plan.device,
        "identical": same,
        "differ": differ[:20],
        "errors": errors[:20],
        "pillow": PIL.__version__,
    }
    if pillow_is_13() or not (differ or errors):
        sec.check(
            "gpu vs cpu preprocessing backends (bit-exact)", not differ and not errors, **detail
        )
    else:
        sec.check(
            "gpu vs cpu preprocessing backends (bit-exact)",
            None,
            reason=f"Pillow differs: {PIL.__version__}, the port follows 13.x",
            **detail,
        )


@dataclass
class CudaTests:
    """``pytest -m cuda`` over the Ray-free test files holding CUDA tests, in a subprocess
    that runs alongside the other checks; its whole log goes to ``pytest_cuda.txt``."""

    process: subprocess.Popen
    log: Path
    files: list[str]
    started: float

    @classmethod
    def start(cls, sec: Section, out: Path) -> CudaTests:
        tests = ROOT / "tests"
        files = sorted(
            str(p.relative_to(ROOT))
            for p in tests.glob("test_*.py")
            if "mark.cuda" in p.read_text()
        )
        command = [
            sys.executable,
            "-m",
            "pytest",
            "-m",
            "cuda",
            "-q",
            "-rfE",
            "-p",
            "no:cacheprovider",
            *files,
        ]
        out.mkdir(parents=True, exist_ok=True)
        log = out / "pytest_cuda.txt"
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}
        with open(log, "w") as sink:
            process = subprocess.Popen(
                command, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT
            )
        sec.notes.append(f"pytest -m cuda started on {len(files)} files")
        return cls(process, log, files, time.monotonic())

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def finish(self, sec: Section) -> None:
        """Wait for the tests within the section's deadline (killed past it), then record."""
        wait = max(1.0, sec.left() - 5)
        try:
            self.process.wait(timeout=wait)
        except BaseException as exc:  # TimeoutExpired, or the section's alarm
            self.stop()
            if not isinstance(exc, subprocess.TimeoutExpired):
                raise
            tail = self.log.read_text(errors="replace")[-2000:]
            sec.check(
                "pytest -m cuda",
                None,
                reason=f"incomplete: still running after "
                f"{time.monotonic() - self.started:.0f} s (section deadline)",
                tail=tail,
            )
            return
        lines = self.log.read_text(errors="replace").strip().splitlines()
        summary = lines[-1] if lines else "(no output)"
        failed = [ln.split(" - ")[0] for ln in lines if ln.startswith(("FAILED", "ERROR"))]
        detail = {
            "files": self.files,
            "summary": summary,
            "failed": failed[:30],
            "rc": self.process.returncode,
            "seconds": time.monotonic() - self.started,
        }
        pillow_only = failed and all(re.search(r"test_(pil_ops|backends)\.py", f) for f in failed)
        if self.process.returncode == 0:
            sec.check("pytest -m cuda", True, **detail)
        elif pillow_only and not pillow_is_13():
            sec.check(
                "pytest -m cuda", None, reason=f"Pillow differs ({PIL.__version__})", **detail
            )
        else:
            sec.check("pytest -m cuda", False, tail="\n".join(lines[-40:]), **detail)


@contextlib.contextmanager
def fp32_exact() -> Iterator[None]:
    """TF32 off for matmuls and convolutions (the float32 comparison needs true float32;
    cuDNN convolutions default to TF32)."""
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def check_fp32_cuda_vs_cpu(sec: Section, cuda_model, pixels, grids) -> None:
    cpu_model = copy.deepcopy(cuda_model).to("cpu")
    want = split_features(cpu_model, pixels.cpu(), grids)
    got = split_features(cuda_model, pixels, grids)
    per_image = [compare(g, w) for g, w in zip(got, want, strict=True)]
    worst = max(p["rel_l2"] for p in per_image)
    tf32 = {
        "matmul": torch.backends.cuda.matmul.allow_tf32,
        "cudnn": torch.backends.cudnn.allow_tf32,
    }
    sec.check(
        "float32 CUDA vs CPU (rel L2 <= 1e-4 per image)",
        worst <= 1e-4,
        grids=grids,
        tf32=tf32,
        per_image=per_image,
    )


def check_bf16_drift(sec: Section, fp32, bf16, pixels, grids) -> None:
    want = split_features(fp32, pixels, grids)
    got = split_features(bf16, pixels.to(torch.bfloat16), grids)
    per_image = [compare(g.float(), w) for g, w in zip(got, want, strict=True)]
    worst = min(p["cosine"] for p in per_image)
    sec.check(
        "bfloat16 vs float32 drift (cosine >= 0.99 per image)",
        worst >= 0.99,
        device=str(pixels.device),
        per_image=per_image,
    )


def check_batch_invariance(sec: Section, bf16, pixels, grids) -> None:
    """An image alone vs inside a batch: the attention op (bitwise with num_splits=1) and
    the whole tower (reported; GEMM kernels may depend on the batch's row count)."""
    device = pixels.device
    chosen = bf16.vision_tower.attention_kernel
    kernel = model_lib.Segments.of(grids, device, torch.bfloat16, chosen).kernel
    rows = [t * h * w for t, h, w in grids]
    index = len(grids) // 2
    start = sum(rows[:index])
    alone_pixels = pixels[start : start + rows[index]].bfloat16()
    (alone,) = split_features(bf16, alone_pixels, [grids[index]])
    batched = split_features(bf16, pixels.bfloat16(), grids)[index]
    tower = compare(batched.float(), alone.float())
    sec.check(
        "batch invariance, whole tower (rel L2 <= 1e-2)",
        tower["rel_l2"] <= 1e-2,
        kernel=kernel,
        grid=grids[index],
        **tower,
    )
    if kernel != "varlen":
        sec.check(
            "batch invariance, attention op (bitwise)",
            None,
            reason=f"skipped: the {kernel} path runs one image at a time",
        )
        return
    if "num_splits" not in model_lib.varlen_options(model_lib.varlen_attn, 128):
        sec.check(
            "batch invariance, attention op (bitwise)",
            None,
            reason="skipped: this torch's varlen_attn has no num_splits",
        )
        return
    lengths = [300, 4096, 17, 1024]
    q, k, v = _random_qkv(lengths, device)
    batched_out = model_lib.attend(q, k, v, _segments(lengths, device, "varlen"))
    part = slice(sum(lengths[:2]), sum(lengths[:3]))
    alone_out = model_lib.attend(
        q[part], k[part], v[part], _segments(lengths[2:3], device, "varlen")
    )
    op = compare(batched_out[part].float(), alone_out.float())
    sec.check("batch invariance, attention op (bitwise)", op["bitwise"], lengths=lengths, **op)


def _random_qkv(lengths, device, heads=12, head_dim=128, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    shape = (sum(lengths), heads, head_dim)
    return [torch.randn(shape, generator=gen, device=device).bfloat16() for _ in range(3)]


def _segments(lengths, device, kernel) -> model_lib.Segments:
    offsets, longest = model_lib.cumulative_lengths(lengths)
    cu = torch.tensor(offsets, dtype=torch.int32, device=device) if kernel == "varlen" else None
    return model_lib.Segments(list(lengths), longest, kernel, cu)


def check_varlen_vs_sdpa(sec: Section, ctx: Context, bf16, pixels, grids) -> None:
    """One varlen call vs one SDPA call per image, bf16 on CUDA. Tolerances: the op's
    outputs are each rounded to bf16 once (relative L2 <= 2^-7); through the tower the
    difference compounds over 27 layers (relative L2 <= 2e-2, cosine >= 0.999)."""
    if model_lib.Segments.of(grids, pixels.device, torch.bfloat16, "auto").kernel != "varlen":
        sec.check("varlen vs per-image SDPA", None, reason="skipped: varlen not available here")
        return
    if ctx.attention != "auto":
        sec.check("varlen vs per-image SDPA", False, reason=f"preflight: {ctx.preflight}")
        return
    lengths = [64, 1024, 3, 256, 777]
    q, k, v = _random_qkv(lengths, pixels.device, seed=1)
    varlen = model_lib.attend(q, k, v, _segments(lengths, pixels.device, "varlen"))
    sdpa = model_lib.attend(q, k, v, _segments(lengths, pixels.device, "sdpa"))
    op = compare(varlen.float(), sdpa.float())
    sec.check(
        "varlen vs per-image SDPA, attention op (rel L2 <= 2^-7)", op["rel_l2"] <= 2**-7, **op
    )
    tower = bf16.vision_tower
    try:
        tower.attention_kernel = "varlen"
        a = torch.cat(split_features(bf16, pixels.bfloat16(), grids)).float()
        tower.attention_kernel = "sdpa"
        b = torch.cat(split_features(bf16, pixels.bfloat16(), grids)).float()
    finally:
        tower.attention_kernel = ctx.attention
    whole = compare(a, b)
    sec.check(
        "varlen vs per-image SDPA, whole tower (rel L2 <= 2e-2, cosine >= 0.999)",
        whole["rel_l2"] <= 2e-2 and whole["cosine"] >= 0.999,
        **whole,
    )


# --------------------------------------------------------------------------- tower


def section_tower(sec: Section, ctx: Context) -> None:
    plan = ctx.plan
    cfg = get_preset(plan.preset).vision
    device, dtype = plan.device, torch.bfloat16
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
            sec.notes.append(f"kernel breakdown failed: {type(exc).__name__}: {exc}")


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


class EventTimedEncoder(VisionEncoder):
    """A VisionEncoder whose forward and materialize are bracketed by CUDA events, so the
    served section can add up the GPU time spent in each."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.spans: list[tuple] = []

    def forward(self, pixels, items):
        with self._span("forward"):
            return super().forward(pixels, items)

    def materialize(self, items, prepared=None):
        with self._span("preprocess"):
            return super().materialize(items, prepared)

    @contextlib.contextmanager
    def _span(self, kind: str) -> Iterator[None]:
        if self.device.type != "cuda":
            started = time.perf_counter()
            yield
            self.spans.append((kind, started, time.perf_counter()))
            return
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        yield
        end.record()
        self.spans.append((kind, begin, end))

    def span_seconds(self) -> dict[str, float]:
        """Seconds per kind (events are complete: the batcher synchronizes every batch)."""
        out: dict[str, float] = {}
        for kind, begin, end in self.spans:
            if isinstance(begin, float):
                seconds = end - begin
            else:
                end.synchronize()
                seconds = begin.elapsed_time(end) / 1e3
            out[kind] = out.get(kind, 0.0) + seconds
        return out


def section_served(sec: Section, ctx: Context) -> None:
    """dp 1 on one device: closed-loop clients through the rank's RankBatcher, in-process."""
    from deployments.batcher import BatchingConfig, RankBatcher

    plan = ctx.plan
    preset = get_preset(plan.preset)
    device = plan.device
    net = ctx.model(preset.vision, torch.bfloat16)
    backend = "gpu" if device == "cuda" else "cpu"
    encoder = EventTimedEncoder(
        net, preset.vision, preset.preprocess, name=f"preset:{plan.preset}", backend=backend
    )
    started = time.perf_counter()
    # Every request encodes (no feature cache).
    batching = BatchingConfig(cache_bytes=0, decode_threads=ctx.decode_threads)
    batcher = RankBatcher(encoder, batching, num_threads=torch.get_num_threads())
    sec.record(
        "setup",
        {
            "batcher_start_s": time.perf_counter() - started,
            "backend": backend,
            "batching": {
                "max_batch_patches": batching.max_batch_patches,
                "max_batch_wait_ms": batching.max_batch_wait_ms,
                "cache": "off",
            },
        },
    )
    sec.record(
        "gpu_idle_method",
        "forward / preprocess seconds: CUDA events around "
        "VisionEncoder.forward / .materialize in the batcher's forward thread (the host "
        "decode runs ahead on the decode pool; preprocess spans cover upload and gpu "
        "preprocessing); idle = 1 - (forward + preprocess) "
        "/ wall, an upper bound on busy time, so idle is a lower bound",
    )
    images = [encoded(photo(w, h, seed=i), "JPEG") for i, (w, h) in enumerate(plan.served_sizes)]
    sec.record("tower_only", tower_only_rate(encoder, images, batching.max_batch_patches, plan))
    for concurrency in plan.concurrencies:
        if not sec.fits(f"concurrency {concurrency}", plan.served_s + 10):
            break
        encoder.spans = []
        result = asyncio.run(closed_loop(batcher, encoder, images, concurrency, plan.served_s))
        spans = encoder.span_seconds()
        wall = result["wall_s"]
        result["forward_share"] = spans.get("forward", 0.0) / wall
        result["preprocess_share"] = spans.get("preprocess", 0.0) / wall
        result["gpu_idle_share"] = max(
            0.0, 1 - result["forward_share"] - result["preprocess_share"]
        )
        result["served_over_tower_only"] = (
            result["images_per_s"] / sec.results["tower_only"]["images_per_s"]
        )
        sec.record(f"concurrency {concurrency}", result)
    info = batcher.info()
    sec.record(
        "batcher",
        {
            k: info[k]
            for k in ("batches", "max_batch_images", "forwarded", "preprocessed", "forward_s")
        },
    )


def tower_only_rate(encoder: VisionEncoder, images: list[bytes], budget: int, plan: Plan) -> dict:
    """Forward alone over one batch of the same images, as large as the batcher can make it:
    within its patch budget and at most as many images as the most clients in flight."""
    items = [encoder.plan(data) for data in images]
    batch = [items[0]]
    while len(batch) < max(plan.concurrencies):
        item = items[len(batch) % len(items)]
        if sum(i.num_patches for i in batch) + item.num_patches > budget:
            break
        batch.append(item)
    pixels = encoder.materialize(batch)
    timing = measure(lambda: encoder.forward(pixels, batch), plan.device, plan.timed_s)
    return {"batch_images": len(batch), **timing, "images_per_s": len(batch) / timing["gpu_s"]}


async def closed_loop(
    batcher, encoder, images: list[bytes], concurrency: int, seconds: float
) -> dict:
    """``concurrency`` clients, each sending one image and waiting for it, for ``seconds``."""
    latencies: list[float] = []
    stages: dict[str, float] = {}
    errors: list[str] = []

    async def client(index: int, stop: float, record: bool) -> None:
        turn = index
        while time.perf_counter() < stop:
            item = encoder.plan(images[turn % len(images)])
            turn += concurrency
            sent = time.perf_counter()
            results, stage_ms = await batcher.encode([item], f"client-{index}", batcher.model_dtype)
            if isinstance(results[0], BaseException):
                errors.append(f"{type(results[0]).__name__}: {results[0]}")
            if record:
                latencies.append(time.perf_counter() - sent)
                for key, value in stage_ms.items():
                    stages[key] = stages.get(key, 0.0) + value

    warm = time.perf_counter() + min(2.0, seconds / 4)
    await asyncio.gather(*(client(i, warm, False) for i in range(concurrency)))
    encoder.spans.clear()
    started = time.perf_counter()
    await asyncio.gather(*(client(i, started + seconds, True) for i in range(concurrency)))
    wall = time.perf_counter() - started
    done = len(latencies)
    return {
        "concurrency": concurrency,
        "images": done,
        "wall_s": wall,
        "images_per_s": done / wall,
        "p50_ms": float(np.percentile(latencies, 50) * 1e3) if done else None,
        "p99_ms": float(np.percentile(latencies, 99) * 1e3) if done else None,
        "mean_stage_ms": {k: v / max(done, 1) for k, v in stages.items()},
        "errors": errors[:5],
    }


# --------------------------------------------------------------------------- output


def markdown(data: dict) -> str:
    lines = [
        f"# GPU check ({data['mode']}, preset {data['preset']})",
        "",
        versions_line(data["versions"]),
        "",
        f"budget {data['budget_s']} s, elapsed {data.get('elapsed_s')} s, "
        f"exit code {data.get('exit_code')}; preflight: {data.get('preflight', 'n/a')}",
        "",
        f"FLOPs: {data['flop_formula']}",
        "",
    ]
    for name, section in data["sections"].items():
        lines += [f"## {name}: {section['status']} ({section['elapsed_s']} s)", ""]
        for check in section["checks"]:
            detail = {k: v for k, v in check.items() if k not in ("name", "status")}
            lines.append(f"- **{check['status']}** {check['name']}: {_brief(detail, 400)}")
        results = section["results"]
        for key, value in results.items():
            if not isinstance(value, dict):
                lines.append(f"- {key}: {_brief(value, 600)}")
        for note in section["notes"]:
            lines.append(f"- note: {note}")
        rows = {k: _flat(v) for k, v in results.items() if isinstance(v, dict) and not _nested(v)}
        lines += _tables(rows)
        for key, value in results.items():
            if isinstance(value, dict) and _nested(value):
                lines += ["", f"{key}:", *_tables({k: _flat(v) for k, v in value.items()})]
        if section.get("error"):
            lines += ["", "```", section["error"], "```"]
        lines.append("")
    return "\n".join(lines)


def _nested(value: dict) -> bool:
    """A dict of rows (each a dict), rendered as a table of its own."""
    return bool(value) and all(isinstance(v, dict) for v in value.values())


def _tables(rows: dict[str, dict]) -> list[str]:
    """Markdown tables: one per distinct set of columns, a row per entry."""
    lines = []
    for columns in dict.fromkeys(tuple(row) for row in rows.values()):
        lines += ["", "| | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
        for key, row in rows.items():
            if tuple(row) == columns:
                cells = [_brief(row[c], 80) for c in columns]
                lines.append("| " + " | ".join([key, *cells]).replace("\n", " ") + " |")
    return lines


def _flat(row: dict, prefix: str = "") -> dict:
    """One level of nesting spelled out: {"a": {"b": 1}} -> {"a.b": 1}."""
    out = {}
    for key, value in row.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _rounded(value):
    if isinstance(value, float):
        return float(f"{value:.4g}") if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return {str(k): _rounded(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_rounded(v) for v in value]
    return value


def _brief(value, limit: int = 240) -> str:
    text = json.dumps(_rounded(value), default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --------------------------------------------------------------------------- main


SECTIONS = {
    "correctness": (section_correctness, 30),  # (function, least seconds worth starting)
    "tower": (section_tower, 20),
    "preprocess": (section_preprocess, 15),
    "served": (section_served, 25),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the two reports")
    parser.add_argument("--budget-s", type=float, default=420.0, help="whole run, seconds")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny preset on CPU (CI)")
    parser.add_argument("--sections", nargs="*", choices=list(SECTIONS), default=list(SECTIONS))
    parser.add_argument(
        "--decode-threads", type=int, default=2, help="the served rank's decode threads"
    )
    parser.add_argument(
        "--attention",
        choices=("auto", "varlen", "sdpa"),
        default="auto",
        help="attention kernel of the throughput sections (auto: the model's own choice)",
    )
    args = parser.parse_args(argv)
    info = versions()
    say(versions_line(info))
    if not args.cpu_smoke and not torch.cuda.is_available():
        parser.error("no CUDA device here; run with --cpu-smoke for the CPU variant")
    plan = SMOKE if args.cpu_smoke else FULL
    report = Report(args.out, info, plan, args.cpu_smoke, args.budget_s)
    ctx = Context(plan, args.out, decode_threads=args.decode_threads)
    if plan.device == "cuda":
        ctx.preflight = report.data["preflight"] = preflight_varlen()
        ctx.attention = ctx.preflight["attention"]
        say(f"preflight: {ctx.preflight}")
    if args.attention != "auto":
        ctx.attention = report.data["attention"] = args.attention
    report.write()
    for name in args.sections:
        fn, min_s = SECTIONS[name]
        run_section(report, name, fn, ctx, min_s)
    say(f"wrote {args.out / 'gpu_check.json'} and gpu_check.md; exit code {report.exit_code()}")
    return report.exit_code()


if __name__ == "__main__":
    sys.exit(main())
