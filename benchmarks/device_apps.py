"""The apps of a device run's ``serve run`` (benchmarks/gpu_served.py and its sections):
what the run measures with, the servers behind each ingress, a window of load on one
app, an app's answers checked against the in-process encoder.

- ``Plan``: full sizes on the GPU, or --cpu-smoke's tiny ones on CPU.
- ``Context``: what the sections hand on (inputs, the tower's rates, the reference
  features, the running ``serve run``).
- ``server``: the ``serve run`` behind Serve's proxy or its HAProxy ingress, started on
  first use with every app of the run, then waited for app by app: ``/off`` (both caches
  off) and ``/on`` (caches on) of configs/k3-8gpu.yaml, and behind the proxy one app per
  switch variant (``Context.variant_apps``). Every rank gets an equal share of the GPU;
  a measured window loads one app at a time, so the GPU is never shared while measured.
  The ranks start together: ``auto`` in ``/off`` and ``/on`` times its probes while the
  other ranks compile and capture, so its choice is made under that load (the tower
  section's modes, one at a time, are the clean comparison).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks.checkout import ROOT
from benchmarks.common import Section, Skip
from benchmarks.served import (
    CONTENT_TYPE,
    Load,
    ServeRun,
    counters,
    inside_rank,
    load,
    multipart,
    served_config,
)
from benchmarks.serving import free_port, get_json
from kimi_encoder.encoder import VisionEncoder

CONFIG = ROOT / "configs" / "k3-8gpu.yaml"


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
    flops_mix: tuple[str, tuple[tuple[int, int, int], ...]]  # the tower's TFLOP/s batch
    apps: dict  # args of every app on top of the config's (flat names)
    variant_args: dict  # and of each switch variant's app
    switch_windows: tuple[tuple[int, int], ...]  # (images per request, clients)
    switch_warm_s: float
    switch_window_s: float
    cache_bytes: tuple[int, int]  # the /on app's rank and ingress caches
    shares: dict[str, float]  # seconds of the budget per section (``device.rolling``)

    def load(self, clients: int) -> Load:
        return Load(clients, self.warm_s, self.window_s, min(self.processes, clients))

    def switch_load(self, clients: int) -> Load:
        procs = min(self.processes, clients)
        return Load(clients, self.switch_warm_s, self.switch_window_s, procs)


@dataclass
class Context:
    plan: Plan
    out: Path
    work: Path  # configs, logs, encoder-cache roots
    images: list[bytes] = field(default_factory=list)  # the square JPEGs
    mixed: list[bytes] = field(default_factory=list)  # square JPEGs and large photos
    tower: dict[str, float] = field(default_factory=dict)  # images/s by set, the best mode's
    tower_by_mode: dict[str, dict[str, float]] = field(default_factory=dict)
    best_mode: str = "auto"  # the tower's fastest execution mode on the square set
    mode_errors: dict[str, str] = field(default_factory=dict)  # modes that did not build
    decode_ms: dict[str, float] = field(default_factory=dict)
    reference: list[torch.Tensor] = field(default_factory=list)  # the probes' features
    encoder: VisionEncoder | None = None
    variant_apps: dict[str, dict] = field(default_factory=dict)  # the proxy run's extra apps
    served_mode: str | None = None  # the mode /off's rank runs ('auto' resolved)
    server: ServeRun | None = None
    kind: str = ""
    failed: dict[str, str] = field(default_factory=dict)

    def ec_root(self, app: str) -> Path:
        return self.work / "ec" / app


# --------------------------------------------------------------------------- servers


def gpu_share(apps: int) -> float:
    """Each of ``apps`` ranks' share of the one GPU, rounded down so that they add up
    to at most 1 (Ray keeps 4 decimals)."""
    return math.floor(1e4 / apps) / 1e4


def run_apps(ctx: Context, kind: str) -> dict[str, dict]:
    """Every app of the ``serve run`` behind ``kind``, by name, with its args (flat names)."""
    plan = ctx.plan
    rank_cache, ingress_cache = plan.cache_bytes
    apps = {
        "off": {"feature_cache_bytes": 0, "ingress_cache_bytes": 0, "ingress_replicas": 2},
        "on": {"feature_cache_bytes": rank_cache, "ingress_cache_bytes": ingress_cache},
    }
    for app, args in apps.items():
        ctx.ec_root(app).mkdir(parents=True, exist_ok=True)
        args |= {"checkpoint": plan.preset, "dp_size": 1, "ec_root": str(ctx.ec_root(app))}
        if kind == "haproxy" and ctx.served_mode:  # as the proxy's /off ran, not measured again
            args["execution"] = ctx.served_mode
    if kind == "proxy":
        for name, args in ctx.variant_apps.items():  # not those whose mode did not build
            if args["execution"] not in ctx.mode_errors:
                apps[name] = {"checkpoint": plan.preset, **args}
    gpus = gpu_share(len(apps)) if plan.device == "cuda" else 0
    for args in apps.values():
        args.setdefault("ingress_replicas", 1)
        args |= plan.apps
        args["rank_actor_options"] = {**plan.apps["rank_actor_options"], "num_gpus": gpus}
    return apps


def server(ctx: Context, kind: str, sec: Section, apps: tuple[str, ...] = ("off", "on")):
    """The ``serve run`` behind ``kind`` ("proxy" or "haproxy"), started on first use (the
    other one stopped first), once ``apps`` are live."""
    if "site" in ctx.failed:
        raise Skip(f"Ray is not importable: {ctx.failed['site']}")
    if ctx.server is None or ctx.kind != kind:
        stop_server(ctx)
        if kind in ctx.failed:
            raise Skip(f"serve run ({kind}) did not start: {ctx.failed[kind]}")
        config = served_config(CONFIG, free_port(), run_apps(ctx, kind))
        haproxy = {"RAY_SERVE_ENABLE_HA_PROXY": "1" if kind == "haproxy" else "0"}
        run = ServeRun(config, ctx.work / kind, ctx.work / f"serve_{kind}.log", haproxy)
        ctx.server, ctx.kind = run.__enter__(), kind
    run = ctx.server
    try:
        ready = run.wait_ready(max(10.0, sec.left() - 20), [f"/{app}" for app in apps])
    except BaseException as exc:
        ctx.failed[kind] = f"{type(exc).__name__}: {str(exc)[:300]}"
        stop_server(ctx)
        raise
    if apps:
        sec.record(f"serve run ({kind}) ready_s", ready)
    return run


def stop_server(ctx: Context) -> None:
    """Stop the running ``serve run`` and keep the end of its log with the report."""
    if ctx.server is None:
        return
    run, ctx.server = ctx.server, None
    run.__exit__(None, None, None)
    (ctx.out / run.log.name).write_bytes(run.log.read_bytes()[-(1 << 20) :])


def rank_info(run: ServeRun, app: str) -> dict:
    """The app's one rank's own report (``/v1/info``)."""
    return get_json(run.client, f"/{app}/v1/info")["ranks"][0]


# --------------------------------------------------------------------------- measuring


def window(ctx: Context, run, app: str, sent, clients: int, tower: str, how: Load | None = None):
    """A closed-loop window of ``sent`` bodies to ``app`` (``how``: the plan's load of
    ``clients``); its figures, its ratio to the tower on the same images, and what the rank
    did in it."""
    prefix, marks = f"/{app}", []

    def take() -> None:
        marks.append(counters(run.client, prefix))

    how = how or ctx.plan.load(clients)
    figures = load(run.client.port, f"{prefix}/v1/encode", sent, CONTENT_TYPE, how, (take, take))
    figures["of_tower"] = figures["images_per_s"] / ctx.tower[tower]
    before, after = marks
    wall = how.window_s
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
