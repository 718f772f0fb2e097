"""Shared fixtures: the oracle data, seeded checkpoints and encoders, and the real Ray Serve
cluster the serve and chaos tests run apps on (CPU, real HTTP on free ports, no mocks):
one Ray cluster and one Serve instance per session, started on first use; a module's
shared apps (a dp size) are deployed on first use under their own name and route prefix
and deleted when the module ends, so idle replicas do not pile up over the session; the
plain dp-2 app, which many modules use, stays for the session."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests/images.py, serve_helpers.py, controlled.py

import ci_skips
from images import image_bytes

from kimi_encoder.encoder import VisionEncoder

TESTS = Path(__file__).resolve().parent

# Ray, Serve and the deployments are imported by the fixtures that start them: the CUDA
# tests run on machines without Ray.

ORACLE = TESTS / "data" / "oracle-k3"

# Markers by folder: the layout says what a test needs (tests/serve/ a real Ray Serve app,
# tests/chaos/ faults under load), so no module marks itself and none can forget to.
FOLDER_MARKERS = {"serve": "serve", "chaos": "chaos"}


# The modules that measure under a load they make themselves (faults under load, the
# device script's served windows on CPU, elastic ranks that must start within a bound
# while the load runs, a rank saturated on purpose that must not be taken for a failed
# one, memory read after a soak's warm-up) run by themselves, after the parallel pass: a
# second worker's cluster on the same two cores would be part of what they measure.
ALONE = (
    "chaos",
    "serve/test_gpu_served.py",
    "serve/test_elastic.py",
    "serve/test_load_not_failure.py",
    "serve/test_soak.py",
)

# A test that runs a device script end to end on CPU (its fixtures run
# benchmarks/gpu_check.py or gpu_served.py as CI does) takes a minute or more, mostly
# waiting on its sections' deadlines: marked `script`, and `make test-fast` leaves it out.
SCRIPT_FIXTURES = {"cpu_smoke", "rehearsal"}

# The folders whose modules take minutes run first: on `make test`'s worker processes
# (pytest-xdist, a module at a time each) the short ones then fill the gaps at the end.
LONG_FIRST = ("chaos", "serve", "benchmarks")


def _relative(item) -> str:
    """The item's module as a path under tests/ ('' for the packages' doctests)."""
    path = Path(str(item.fspath)).resolve()
    return path.relative_to(TESTS).as_posix() if TESTS in path.parents else ""


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items) -> None:
    order = {folder: i for i, folder in enumerate(LONG_FIRST)}
    rank = {}
    for item in items:
        relative = _relative(item)
        folder = relative.split("/", 1)[0]
        if folder in FOLDER_MARKERS:
            item.add_marker(FOLDER_MARKERS[folder])
        if any(relative == alone or relative.startswith(f"{alone}/") for alone in ALONE):
            item.add_marker("alone")
        if SCRIPT_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker("script")
        rank[item.nodeid] = order.get(folder, len(LONG_FIRST))
    items.sort(key=lambda item: rank[item.nodeid])  # stable


def pytest_configure(config) -> None:
    ci_skips.register(config)  # with CI=true, a skip CI does not allow fails the run


@pytest.fixture(scope="session")
def oracle_dir() -> Path:
    return ORACLE


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    from kimi_encoder.config import get_preset
    from kimi_encoder.weights import write_checkpoint

    preset = get_preset("tiny")
    return write_checkpoint(tmp_path_factory.mktemp("tiny"), preset.vision, preset.preprocess, 7)


@pytest.fixture(scope="session")
def oracle_encoder():
    return VisionEncoder.from_pretrained(ORACLE / "checkpoint", device="cpu", backend="cpu")


# The buckets of the 'padded' encoders: small enough that the tests' images fill, overflow
# and share them (a tiny-preset image has at most 1024 patches).
PADDED_BUCKETS = (16, 64, 256, 1024, 4096)


@pytest.fixture(scope="session")
def encoder_in() -> Callable[..., VisionEncoder]:
    """``encoder_in(checkpoint, mode, dtype="float32")``: a CPU encoder (cpu backend) whose
    tower runs as ``mode``: 'eager', 'compiled', or 'padded' (the graphs mode's buckets and
    padding, run without capture: ``PADDED_BUCKETS``, 8 images each). Built once per
    session: the compiled ones compile once. A compiled encoder's ``graphs_compiled`` is
    how many graphs its build compiled."""
    from torch._dynamo.utils import counters

    from kimi_encoder.execution import BucketRunner, Execution

    made: dict[tuple, VisionEncoder] = {}

    def _make(checkpoint, mode: str, dtype: str = "float32") -> VisionEncoder:
        key = (str(checkpoint), mode, dtype)
        if key not in made:
            before = counters["stats"]["unique_graphs"]
            execution = "compiled" if mode == "compiled" else "eager"
            encoder = VisionEncoder.from_pretrained(
                checkpoint, device="cpu", dtype=dtype, backend="cpu", execution=execution
            )
            encoder.graphs_compiled = counters["stats"]["unique_graphs"] - before
            if mode == "padded":
                runner = BucketRunner(encoder.model, PADDED_BUCKETS, 8, capture=False)
                encoder.execution = Execution("padded", runner, {})
            made[key] = encoder
        return made[key]

    return _make


@pytest.fixture(scope="session")
def images() -> list[bytes]:
    from serve_helpers import IMAGE_SPECS

    return [image_bytes(mode, size, seed, fmt=fmt) for mode, size, seed, fmt in IMAGE_SPECS]


@pytest.fixture(scope="module")
def ec_root(tmp_path_factory) -> Path:
    """A module's vLLM encoder-cache directory (the consumer's shared_storage_path)."""
    return tmp_path_factory.mktemp("ec")


@pytest.fixture(scope="session")
def reference() -> VisionEncoder:
    """The in-process encoder the ranks must reproduce (same preset, seed and backend)."""
    return VisionEncoder.from_pretrained("tiny", device="cpu", dtype="float32", backend="cpu")


@pytest.fixture(scope="session")
def serve_url() -> Iterator[str]:
    import ray
    from ray import serve
    from serve_helpers import free_port

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


# name -> base URL of the `deploy` apps now running.
_APPS: dict[str, str] = {}

# The plain dp-2 app (`deploy(2)`, no overrides) is shared by half a dozen modules: kept for
# the session by the worker that started it, so each of them does not start it again.
SHARED_APPS = frozenset({"dp2"})


@pytest.fixture(scope="module", autouse=True)
def _delete_apps_after_module() -> Iterator[None]:
    """Delete the module's `deploy` apps when it ends, but the shared one. Every idle
    replica costs a few percent of a core (Serve's health checks, metrics and load polls);
    kept for the whole session, dozens of them starved the later tests on a two-core
    machine."""
    yield
    _delete_apps()


def _delete_apps(but: str | None = None) -> None:
    """Delete the `deploy` apps now running, but the shared ones and ``but``."""
    ended = [name for name in _APPS if name not in SHARED_APPS and name != but]
    if ended:
        from ray import serve

        for name in ended:
            serve.delete(name)
            del _APPS[name]


@pytest.fixture(scope="session")
def deploy(serve_url: str) -> Callable[..., str]:
    """``deploy(dp_size)`` -> base URL of a running app with that many ranks.

    ``deploy(dp_size, name, **overrides)``: an app of its own with other AppArgs
    (an API key file, a short timeout, ...), shared under ``name`` by the module's tests.

    ``only=True``: the module's other apps (the session's shared one aside) are deleted
    first, for a module whose tests use its apps one after the other: each idle replica
    left running slows every test after it.
    """
    from ray import serve
    from serve_helpers import REFERENCE_PATH, app_args

    from deployments.app import bind_app

    def _deploy(dp_size: int, name: str | None = None, *, only: bool = False, **overrides) -> str:
        assert name is not None or not overrides, "an app with overrides needs its own name"
        name = name or f"dp{dp_size}"
        if only:
            _delete_apps(but=name)
        if name not in _APPS:
            args = app_args(REFERENCE_PATH, dp_size=dp_size, **overrides)
            serve.run(bind_app(args), name=name, route_prefix=f"/{name}")
            _APPS[name] = f"{serve_url}/{name}"
        return _APPS[name]

    return _deploy


@pytest.fixture(scope="session")
def cpu_smoke(tmp_path_factory) -> Callable[..., tuple[subprocess.CompletedProcess, Path]]:
    """``cpu_smoke(name, timeout, **env)`` runs ``benchmarks/{name}.py --cpu-smoke`` as CI
    does: as a script from the repository root (``env`` on top of this environment), its
    reports written to a folder of its own. The finished process and that folder."""

    def _run(name: str, timeout: float, **env: str) -> tuple[subprocess.CompletedProcess, Path]:
        out = tmp_path_factory.mktemp(name)
        script = TESTS.parent / "benchmarks" / f"{name}.py"
        command = [sys.executable, str(script), "--cpu-smoke", "--out", str(out)]
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout, env={**os.environ, **env}
        )
        return done, out

    return _run
