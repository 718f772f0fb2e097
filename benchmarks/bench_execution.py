"""Tower execution modes on CPU: compiled against eager, side by side.

    python -m benchmarks.bench_execution [--quick] [--presets tiny small]

For each preset: bench_encoder's fixed image mix (``inputs.MODE_MIX``) in one forward
(tower + projector, ``VisionEncoder.forward``), one torch thread, preprocessing done
before the clock starts. An eager and a compiled encoder are built once; then windows
alternate them (eager, compiled, eager, ...): images/s per window, median (min–max),
and the ratio compiled / eager per repeat. Compile time is reported apart: the compiled
encoder built from a cold cache (the first compilation of the preset's shapes in this
process, inductor's on-disk cache in an empty folder), then built again with dynamo's
caches reset and the on-disk cache the first build left (what a restarted rank pays on
the same machine). ``auto`` on CPU is eager (``kimi_encoder.execution.CPU_RULE``).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Callable

import torch

from kimi_encoder.encoder import VisionEncoder
from kimi_encoder.execution import CPU_RULE

from .common import Section, alternate, ratio, spread, table
from .inputs import MODE_MIX, mode_mix
from .page import arguments, standalone

WINDOW_S = {"tiny": 3.0, "small": 10.0}  # a small window holds about one forward


def window(encoder: VisionEncoder, pixels, items, seconds: float) -> Callable[[], float]:
    """Images/s of forwards over the mix for at least ``seconds`` (one forward at least)."""

    def measure() -> float:
        calls, started = 0, time.perf_counter()
        while True:
            encoder.forward(pixels, items)
            calls += 1
            elapsed = time.perf_counter() - started
            if elapsed >= seconds:
                return len(items) * calls / elapsed

    return measure


def build_compiled(preset: str) -> tuple[VisionEncoder, float, float]:
    """(compiled encoder, cold build seconds, warm build seconds): cold with an empty
    on-disk cache, warm after ``torch._dynamo.reset()`` with the cache the cold one left."""
    saved = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    with tempfile.TemporaryDirectory() as cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
        try:
            seconds = []
            for _ in range(2):
                torch._dynamo.reset()
                started = time.perf_counter()
                encoder = VisionEncoder.from_pretrained(
                    preset, device="cpu", backend="cpu", execution="compiled"
                )
                seconds.append(time.perf_counter() - started)
        finally:
            if saved is None:
                os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
            else:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = saved
    return encoder, seconds[0], seconds[1]


def bench_preset(preset: str, images: list[bytes], repeats: int, seconds: float) -> dict:
    eager = VisionEncoder.from_pretrained(preset, device="cpu", backend="cpu", execution="eager")
    started = time.perf_counter()
    VisionEncoder.from_pretrained(preset, device="cpu", backend="cpu", execution="eager")
    eager_build = time.perf_counter() - started
    compiled, cold, warm = build_compiled(preset)
    items = [eager.plan(data) for data in images]
    pixels = eager.materialize(items)
    worst = max(
        (a - b).abs().max().item()
        for a, b in zip(compiled.forward(pixels, items), eager.forward(pixels, items), strict=True)
    )
    rates = alternate(
        {
            "eager": window(eager, pixels, items, seconds),
            "compiled": window(compiled, pixels, items, seconds),
        },
        repeats,
    )
    return {
        "patches": sum(item.num_patches for item in items),
        "eager": spread(rates["eager"]),
        "compiled": spread(rates["compiled"]),
        "ratio": ratio(rates["compiled"], rates["eager"]),
        "eager_build": eager_build,
        "cold": cold,
        "warm": warm,
        "max_diff": worst,
    }


def sections(quick: bool, presets: tuple[str, ...] = ("tiny", "small")) -> list[Section]:
    torch.set_num_threads(1)
    repeats = 2 if quick else 5
    count = 4 if quick else len(MODE_MIX)  # quick: without the 1920x1080 image
    images = mode_mix()[:count]
    rows, builds = [], []
    for preset in presets:
        seconds = WINDOW_S.get(preset, 3.0) / (3 if quick else 1)
        r = bench_preset(preset, images, repeats, seconds)
        rows.append(
            [
                preset,
                r["patches"],
                r["eager"].fmt(2),
                r["compiled"].fmt(2),
                f"**{r['ratio'].fmt(2, 'x')}**",
                f"{r['max_diff']:.1e}",
            ]
        )
        builds.append([preset, f"{r['eager_build']:.1f}", f"{r['cold']:.1f}", f"{r['warm']:.1f}"])
    mix = ", ".join(f"{m} {w}x{h}" for m, (w, h) in MODE_MIX[:count])
    conditions = (
        f"The batch {mix} in one forward (tower + projector, preprocessing done before), one "
        f"torch thread, seeded preset weights; {repeats} repeats alternating eager and "
        "compiled, windows of at least one forward (tiny 3 s, small 10 s; quick: a third): "
        "images/s, median (min–max); the ratio is compiled / eager per repeat. Max abs diff: "
        "the largest difference of a feature between the two modes (float32)."
    )
    header = ["preset", "patches", "eager, images/s", "compiled, images/s", "compiled / eager"]
    build_note = (
        "Start-up cost, seconds: building the encoder (seeded weights) eagerly; compiled from "
        "a cold cache (the first compilation of these shapes in the process, an empty "
        "inductor cache folder); compiled again after `torch._dynamo.reset()` with the "
        "on-disk cache the cold build left. `auto` on CPU is eager "
        f"(`kimi_encoder.execution.CPU_RULE`: {CPU_RULE})."
    )
    build_header = ["preset", "eager build", "compiled build, cold", "compiled build, warm"]
    return [
        Section(
            "Tower execution modes (CPU: compiled vs eager)",
            "python -m benchmarks.bench_execution",
            [
                conditions,
                table([*header, "max abs diff"], rows),
                build_note,
                table(build_header, builds),
            ],
        )
    ]


def main(argv: list[str] | None = None) -> int:
    parser = arguments(__doc__)
    parser.add_argument("--presets", nargs="+", default=["tiny", "small"])
    args = parser.parse_args(argv)
    return standalone(
        __doc__, lambda a: sections(a.quick, tuple(args.presets)), argv, parser=parser
    )


if __name__ == "__main__":
    sys.exit(main())
