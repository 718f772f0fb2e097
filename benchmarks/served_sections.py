"""The sections of benchmarks/gpu_served.py that measure the served product around the
tower (the tower's own are benchmarks/tower_modes.py, the switches' benchmarks/switches.py),
each run in a process of its own against the driver's ``serve run`` (``Context.served``).

- ``section_site``: Ray importable (the carried site unpacked), versions.
- ``section_http_off`` / ``section_http_cached``: configs/k3-8gpu.yaml as it ships behind
  Serve's proxy, ``/off`` (both caches off) and ``/on`` (every image cached): 1 and 8
  images per request, 8 and 32 clients, and the mixed set; inside the rank, per image.
- ``section_sglang`` / ``section_vllm``: the engines' hand-off paths, cache off and cached.
- ``section_batcher``: the rank's batcher in-process, the tower's fastest mode.
- ``section_haproxy``: ``/off`` and ``/on`` again behind Serve's HAProxy ingress.

Every ratio divides by the fastest mode's tower measured so far (``denominators`` records
which; a section without one says so and leaves its ratios empty).
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks import tower_modes
from benchmarks.common import Section
from benchmarks.device import float32_settings
from benchmarks.device_apps import Context, check_answers, denominators, rank_info, window
from benchmarks.inprocess import batcher_section
from benchmarks.served import (
    BUNDLE,
    carried_site,
    counters,
    has_haproxy,
    inside_rank,
    multipart_bodies,
    warm,
)
from kimi_encoder.config import get_preset
from kimi_encoder.execution import ExecutionConfig

SITE = Path(tempfile.gettempdir()) / "kimi-encoder-site"  # where the carried site unpacks


def section_site(sec: Section, ctx: Context) -> None:
    site = carried_site(BUNDLE, SITE)
    import ray

    where = site or "installed"
    sec.record("ray", {"version": ray.__version__, "site": where, "haproxy": has_haproxy()})
    sec.record("fp32_precision", float32_settings())


def section_batcher(sec: Section, ctx: Context) -> None:
    plan = ctx.plan
    mode, _ = ctx.tower("square")
    if mode is None:
        sec.note("no tower figure to choose the fastest mode from: the batcher runs eager")
    enc = tower_modes.load(sec, ctx)
    args = (ctx.images, plan.clients, plan.window_s, plan.timed_s, 4)
    execution = ExecutionConfig(mode or "eager")  # buckets up to the batcher's own budget
    name = f"preset:{plan.preset}"
    batcher_section(sec, enc.model, get_preset(plan.preset), name, *args, execution=execution)
    denominators(sec, ctx)
    for key, row in list(sec.results.items()):
        if key.startswith("concurrency"):
            sec.record(key, {**row, "of_tower": ctx.of_tower(row["images_per_s"], "square")})


def section_http_off(sec: Section, ctx: Context) -> None:
    run = ctx.served("proxy")
    run.needs("off")
    denominators(sec, ctx)
    check_answers(sec, ctx, run, "off")
    for per in ctx.plan.per_request:
        for clients in ctx.plan.clients:
            row = window(ctx, run, "off", multipart_bodies(ctx.images, per), clients, "square")
            sec.record(f"{per} per request, {clients} clients", row)
    row = window(ctx, run, "off", multipart_bodies(ctx.mixed, 8), min(ctx.plan.clients), "mixed")
    sec.record(f"mixed set, 8 per request, {min(ctx.plan.clients)} clients", row)
    errors = sum(r["errors"] for r in sec.results.values() if isinstance(r, dict) and "errors" in r)
    sec.check("every request answered 200", errors == 0, errors=errors)
    sec.record("execution", rank_info(run, "off").get("execution") or {})


def section_http_cached(sec: Section, ctx: Context) -> None:
    run = ctx.served("proxy")
    run.needs("on")
    denominators(sec, ctx)
    warm(run, "on", multipart_bodies(ctx.images, 8))
    check_answers(sec, ctx, run, "on")
    encoded_images = 0
    for per in ctx.plan.per_request:
        for clients in ctx.plan.clients:
            row = window(ctx, run, "on", multipart_bodies(ctx.images, per), clients, "square")
            encoded_images += row["rank"]["images"]
            sec.record(f"{per} per request, {clients} clients", row)
    sec.check("every image a cache hit (none encoded)", encoded_images == 0, encoded=encoded_images)


def part_rows(sec: Section, ctx: Context, run, name: str, send: Callable[[str, float], tuple]):
    """Both apps through one hand-off path: a warm-up window, then the measured one."""
    clients, per = max(ctx.plan.clients) // 4 or 1, 8
    _, tower = ctx.tower("square")
    for app in ("off", "on"):
        run.needs(app)
        send(app, ctx.plan.warm_s)
        before = counters(run.client, f"/{app}")
        started = time.monotonic()
        mb_per_s, parts_per_s, parts = send(app, ctx.plan.window_s)
        after = counters(run.client, f"/{app}")
        wall = time.monotonic() - started
        row = {"clients": clients, "per_part": per, "parts": parts, "mb_per_s": mb_per_s}
        row |= {
            "images_per_s": parts_per_s * per,
            "of_tower": ctx.of_tower(parts_per_s * per, "square"),
        }
        row["rank"] = inside_rank(before, after, wall, tower, ctx.decode_ms.get("square"))
        sec.record(f"{name}, {'cache off' if app == 'off' else 'every image cached'}", row)


def section_sglang(sec: Section, ctx: Context) -> None:
    import zmq

    from benchmarks.paths import Sink, handoff

    run = ctx.served("proxy")
    denominators(sec, ctx)
    parts = [ctx.images[k * 8 : k * 8 + 8] for k in range(max(1, len(ctx.images) // 8))]
    context = zmq.Context()
    sink = Sink(context)
    clients, sent = max(ctx.plan.clients) // 4 or 1, [0]
    try:

        def send(app: str, seconds: float) -> tuple:
            figures = handoff(run.client, f"/{app}/encode", sink, parts, seconds, clients)
            sent[0] += figures[2]
            return figures

        part_rows(sec, ctx, run, "parts of 8", send)
        got = {"parts": sent[0], "messages": sink.messages}
        sec.check("every part's frames reached the sink", sent[0] == sink.messages, **got)
    finally:
        sink.close()
        context.term()


def section_vllm(sec: Section, ctx: Context) -> None:
    from benchmarks.paths import vllm_files

    run = ctx.served("proxy")
    denominators(sec, ctx)
    # 8 distinct requests: their files are replaced in place, so the tmpfs stays small.
    parts = [ctx.images[k * 8 : k * 8 + 8] for k in range(max(1, min(8, len(ctx.images) // 8)))]
    sec.record("ec_root", str(ctx.ec_root("off").parent))
    clients = max(ctx.plan.clients) // 4 or 1

    def send(app: str, seconds: float) -> tuple:
        return vllm_files(run.client, f"/{app}", parts, seconds, clients)

    part_rows(sec, ctx, run, "requests of 8", send)
    files = [p for app in ("off", "on") for p in ctx.ec_root(app).rglob("*") if p.is_file()]
    complete = all(p.name == "encoder_cache.safetensors" and p.stat().st_size for p in files)
    sec.check("every file complete, no temporary left", bool(files) and complete, files=len(files))


def section_haproxy(sec: Section, ctx: Context) -> None:
    run = ctx.served("haproxy")
    denominators(sec, ctx)
    warm(run, "on", multipart_bodies(ctx.images, 8))
    for app in ("off", "on"):
        run.needs(app)
        check_answers(sec, ctx, run, app)
        clients = min(ctx.plan.clients)
        row = window(ctx, run, app, multipart_bodies(ctx.images, 8), clients, "square")
        cache = "cache off" if app == "off" else "every image cached"
        sec.record(f"{cache}, 8 per request, {clients} clients", row)
