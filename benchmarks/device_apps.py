"""The apps of a device run's ``serve run`` (benchmarks/gpu_served.py and its sections),
and what its sections hand on to each other.

- ``Plan``: full sizes on the GPU, or --cpu-smoke's tiny ones on CPU.
- ``Context``: what every section gets. Each section runs in a process of its own
  (benchmarks/isolated.py), so what one hands on to the next travels as files in the
  run's work folder, read when needed: the inputs, the tower's figures by mode (each
  written as soon as it is measured, so a section killed midway leaves what it had),
  the reference features, the address of the running ``serve run``.
- ``Servers`` (the driver's): the ``serve run`` behind Serve's proxy or its HAProxy
  ingress, started with every app of the run and waited for until all are live, before
  any measured window: ``/off`` (both caches off) and ``/on`` (caches on) of
  configs/k3-8gpu.yaml, and behind the proxy one app per switch variant
  (``Context.variant_apps``). Every rank gets an equal share of the GPU; a measured
  window loads one app at a time, and with every app live first no rank is still
  compiling, capturing or timing ``auto``'s candidates during one. The ranks start
  together: ``auto`` in ``/off`` and ``/on`` times its candidates while the other ranks
  compile and capture, so its choice is made under that load (the tower sections' modes,
  one at a time, are the clean comparison).
- ``window``: a closed-loop window on one app, its ratio to the tower (the fastest mode
  measured on the same set; None, and the section says so, where there is none) and what
  the rank did in it.
"""

from __future__ import annotations

import json
import math
import pickle
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks.checkout import ROOT
from benchmarks.common import Section, SectionTimeout, Skip
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
from benchmarks.serving import Http, free_port, get_json
from kimi_encoder.encoder import VisionEncoder

CONFIG = ROOT / "configs" / "k3-8gpu.yaml"
MODES = ("eager", "graphs", "compiled")  # in the order the tower measures them
SETS = ("square", "mixed")


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
    batch_patches: int  # a rank's largest batch: the tower's batches, the graphs' buckets
    flops_mix: tuple[str, tuple[tuple[int, int, int], ...]]  # the tower's TFLOP/s batch
    apps: dict  # args of every app on top of the config's (flat names)
    variant_args: dict  # and of each switch variant's app
    switch_windows: tuple[tuple[int, int], ...]  # (images per request, clients)
    switch_warm_s: float
    switch_window_s: float
    cache_bytes: tuple[int, int]  # the /on app's rank and ingress caches
    shares: dict[str, float]  # seconds of the budget per section (``device.Rolling``)
    optional: tuple[str, ...]  # sections run only when --sections names them
    budget_s: float  # the whole run's, shutdown included

    def load(self, clients: int) -> Load:
        return Load(clients, self.warm_s, self.window_s, min(self.processes, clients))

    def switch_load(self, clients: int) -> Load:
        procs = min(self.processes, clients)
        return Load(clients, self.switch_warm_s, self.switch_window_s, procs)


@dataclass
class Context:
    plan: Plan
    out: Path
    work: Path  # the hand-off files, configs, logs, encoder-cache roots
    images: list[bytes] = field(default_factory=list)  # the square JPEGs
    mixed: list[bytes] = field(default_factory=list)  # square JPEGs and large photos
    decode_ms: dict[str, float] = field(default_factory=dict)  # PIL decode per image, by set
    unsupported: dict[str, str | None] = field(default_factory=dict)  # why a mode cannot run
    variant_apps: dict[str, dict] = field(default_factory=dict)  # the proxy run's extra apps

    def save(self) -> None:
        """What every section reads (the driver writes it once, before the first)."""
        (self.work / "inputs.pkl").write_bytes(pickle.dumps((self.images, self.mixed)))
        fields = ("decode_ms", "unsupported", "variant_apps")
        self.write("run", {name: getattr(self, name) for name in fields})

    @classmethod
    def load(cls, plan: Plan, out: Path, work: Path) -> Context:
        """The driver's context, in a section's own process."""
        images, mixed = pickle.loads((work / "inputs.pkl").read_bytes())
        run = json.loads((work / "run.json").read_text())
        fields = {name: run[name] for name in ("decode_ms", "unsupported", "variant_apps")}
        return cls(plan, out, work, images, mixed, **fields)

    # --- files of the work folder

    def read(self, name: str) -> dict:
        path = self.work / f"{name}.json"
        return json.loads(path.read_text()) if path.exists() else {}

    def write(self, name: str, data: dict) -> None:
        """Whole or not at all: a process killed while writing leaves the previous file."""
        tmp = self.work / f".{name}.json.tmp"
        tmp.write_text(json.dumps(data, default=str))
        tmp.replace(self.work / f"{name}.json")

    def section_file(self, name: str) -> Path:
        (self.work / "sections").mkdir(exist_ok=True)
        return self.work / "sections" / (name.replace(" ", "_").replace(",", "") + ".json")

    # --- the tower's figures

    def put_tower(self, mode: str, figures: dict) -> None:
        """Figures of the tower alone in ``mode`` (its row of ``tower by mode``: a set's
        rate as ``"square images_per_s"``), each written as soon as it exists."""
        data = self.read("tower")
        data[mode] = {**data.get(mode, {}), **figures}
        self.write("tower", data)

    def tower_by_mode(self) -> dict[str, dict]:
        return self.read("tower")

    def tower(self, kind: str) -> tuple[str | None, float | None]:
        """The fastest execution mode on ``kind``'s set among those measured so far, and its
        images/s; (None, None) when none was."""
        rows, key = self.tower_by_mode(), f"{kind} images_per_s"
        rates = {mode: rows[mode][key] for mode in MODES if rows.get(mode, {}).get(key)}
        if not rates:
            return None, None
        best = max(rates, key=rates.get)
        return best, rates[best]

    def of_tower(self, images_per_s: float, kind: str) -> float | None:
        _, rate = self.tower(kind)
        return images_per_s / rate if rate else None

    def mode_errors(self) -> dict[str, str]:
        """Modes that failed in their tower section: not served either."""
        return {mode: row["error"] for mode, row in self.tower_by_mode().items() if "error" in row}

    # --- the reference features, the server

    def reference(self) -> list[torch.Tensor]:
        """The probes' features from the in-process eager encoder: as the tower section
        wrote them, or computed here (and written) where it did not."""
        path = self.work / "reference.pt"
        if not path.exists():
            plan = self.plan
            enc = VisionEncoder.from_pretrained(
                plan.preset, device=plan.device, dtype=plan.dtype, execution="eager"
            )
            self.save_reference(enc)
            del enc
        return torch.load(path, weights_only=True)

    def save_reference(self, enc: VisionEncoder) -> None:
        with torch.inference_mode():
            probes = [enc.encode([enc.plan(data)])[0].float().cpu() for data in self.images[:2]]
        torch.save(probes, self.work / ".reference.pt")
        (self.work / ".reference.pt").replace(self.work / "reference.pt")

    def served(self, kind: str) -> Served:
        """The driver's ``serve run`` behind ``kind``, as its start left it."""
        info = self.read("server")
        if info.get("kind") != kind or "port" not in info:
            why = info.get("failed") if info.get("kind") == kind else "its start did not run"
            raise Skip(f"no serve run ({kind}): {why}")
        return Served(kind, Http(info["port"]), info["live"])

    def ec_root(self, app: str) -> Path:
        return self.work / "ec" / app


def denominators(sec: Section, ctx: Context) -> None:
    """Record the tower figures this section's ratios divide by; say so where none exists."""
    rows = {}
    for kind in SETS:
        mode, rate = ctx.tower(kind)
        rows[kind] = {"mode": mode, "images_per_s": rate}
        if rate is None:
            sec.note(f"no tower figure for the {kind} set: its ratios are left empty")
    sec.record("tower denominators", rows)


# --------------------------------------------------------------------------- servers


@dataclass
class Served:
    """A section's view of the driver's ``serve run``: a client, and each live app's
    seconds from the start until it was live."""

    kind: str
    client: Http
    live: dict[str, float | None]

    def needs(self, app: str) -> None:
        """Raise unless ``app`` is live (now, if it was not yet when its start ended)."""
        if app in self.live:
            return
        try:
            ranks = get_json(self.client, f"/{app}/v1/info", timeout_s=5)["ranks"]
        except (OSError, ValueError, KeyError):
            ranks = []
        if not ranks or any(rank.get("state") != "live" for rank in ranks):
            raise RuntimeError(f"/{app} of the serve run ({self.kind}) is not live: {ranks}")
        self.live[app] = None  # live, later than its start waited for it


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
    served_mode = ctx.read("server_modes").get("off")
    for app, args in apps.items():
        ctx.ec_root(app).mkdir(parents=True, exist_ok=True)
        args |= {"checkpoint": plan.preset, "dp_size": 1, "ec_root": str(ctx.ec_root(app))}
        if kind == "haproxy" and served_mode:  # as the proxy's /off ran, not measured again
            args["execution"] = served_mode
    if kind == "proxy":
        failed = ctx.mode_errors()
        for name, args in ctx.variant_apps.items():  # not those whose mode failed
            if args["execution"] not in failed:
                apps[name] = {"checkpoint": plan.preset, **args}
    gpus = gpu_share(len(apps)) if plan.device == "cuda" else 0
    for args in apps.values():
        args.setdefault("ingress_replicas", 1)
        args |= plan.apps
        args["rank_actor_options"] = {**plan.apps["rank_actor_options"], "num_gpus": gpus}
    return apps


class Servers:
    """The driver's ``serve run``, one at a time: started with every app of its kind and
    waited for until all are live; its address handed to the sections in the work folder
    (``Context.served``)."""

    def __init__(self, ctx: Context):
        self.ctx = ctx
        self.run: ServeRun | None = None
        self.kind: str | None = None

    def start(self, sec: Section, kind: str) -> None:
        """The ``serve run`` behind ``kind`` ("proxy" or "haproxy"): when each app was live
        and how each rank runs the tower (its ``/v1/info`` execution, as it reports it)."""
        ctx = self.ctx
        self.stop(30)
        ctx.write("server", {"kind": kind, "failed": "still starting when its step ended"})
        try:
            apps = run_apps(ctx, kind)
            config = served_config(CONFIG, free_port(), apps)
            haproxy = {"RAY_SERVE_ENABLE_HA_PROXY": "1" if kind == "haproxy" else "0"}
            run = ServeRun(config, ctx.work / kind, ctx.work / f"serve_{kind}.log", haproxy)
            self.run, self.kind = run.__enter__(), kind
            sec.record("apps", sorted(apps))
            deadline = time.monotonic() + max(5.0, sec.left() - 8)
            ready = {p[1:]: s for p, s in run.wait_live([f"/{a}" for a in apps], deadline).items()}
        except BaseException as exc:
            ctx.write("server", {"kind": kind, "failed": f"{type(exc).__name__}: {str(exc)[:300]}"})
            raise
        sec.record("ready_s", ready)
        ctx.write("server", {"kind": kind, "port": run.client.port, "live": ready})
        modes = executions(run, list(ready))
        sec.record("execution by app", modes)
        if kind == "proxy":
            ctx.write("server_modes", {app: e.get("mode") for app, e in modes.items()})
        waiting = sorted(set(apps) - set(ready))
        seconds = round(time.monotonic() - run.started)
        sec.check("every app live before any window", not waiting, waiting=waiting, after_s=seconds)

    def stop(self, wait_s: float) -> None:
        """Stop the running ``serve run`` (killed after ``wait_s``) and keep the end of its
        log with the report."""
        if self.run is None:
            return
        run, self.run, self.kind = self.run, None, None
        self.ctx.write("server", {"kind": None, "failed": "stopped"})
        run.stop(wait_s)
        (self.ctx.out / run.log.name).write_bytes(run.log.read_bytes()[-(1 << 20) :])


def rank_info(run: ServeRun | Served, app: str) -> dict:
    """The app's one rank's own report (``/v1/info``)."""
    return get_json(run.client, f"/{app}/v1/info")["ranks"][0]


def executions(run: ServeRun | Served, apps: list[str]) -> dict[str, dict]:
    """How each app's rank runs the tower, as its ``/v1/info`` ``execution`` says: every key
    it reports (mode, measured_ms, build_s, the buckets' batches, the eager ones, and
    whatever a rank adds), read as they come."""
    out = {}
    for app in apps:
        try:
            out[app] = rank_info(run, app).get("execution") or {}
        except SectionTimeout:
            raise
        except Exception as exc:  # noqa: BLE001 - recorded; the figures stand without it
            out[app] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    return out


# --------------------------------------------------------------------------- measuring


def window(ctx: Context, run, app: str, sent, clients: int, tower: str, how: Load | None = None):
    """A closed-loop window of ``sent`` bodies to ``app`` (``how``: the plan's load of
    ``clients``); its figures, its ratio to the tower on the same images (None without a
    tower figure), and what the rank did in it."""
    prefix, marks = f"/{app}", []

    def take() -> None:
        marks.append(counters(run.client, prefix))

    how = how or ctx.plan.load(clients)
    figures = load(run.client.port, f"{prefix}/v1/encode", sent, CONTENT_TYPE, how, (take, take))
    _, rate = ctx.tower(tower)
    figures["of_tower"] = ctx.of_tower(figures["images_per_s"], tower)
    before, after = marks
    figures["rank"] = inside_rank(before, after, how.window_s, rate, ctx.decode_ms.get(tower))
    return figures


def check_answers(sec: Section, ctx: Context, run, app: str) -> None:
    """The probes' features as ``app`` answers them against the in-process encoder's:
    float32 within 1e-4; bfloat16 (other batches round otherwise) cosine >= 0.999."""
    from safetensors.torch import load as load_tensors

    reference = ctx.reference()
    probes = ctx.images[: len(reference)]
    body, kind = multipart(probes, response_format="safetensors")
    data, _ = run.client.post(f"/{app}/v1/encode", body, kind)
    tensors = load_tensors(data)
    got = [tensors[f"features.{i}"].float() for i in range(len(probes))]
    shapes = [tuple(g.shape) for g in got] == [tuple(r.shape) for r in reference]
    if ctx.plan.dtype == "float32":
        worst = max(float((g - r).abs().max()) for g, r in zip(got, reference, strict=True))
        sec.check(f"/{app} answers match the encoder", shapes and worst <= 1e-4, max_abs=worst)
    else:
        pairs = zip(got, reference, strict=True)
        cos = min(float(torch.cosine_similarity(g.flatten(), r.flatten(), dim=0)) for g, r in pairs)
        sec.check(f"/{app} answers match the encoder", shapes and cos >= 0.999, cosine=cos)
