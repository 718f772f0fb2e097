"""benchmarks/gpu_served.py: its CPU twin (tiny preset, CPU, ``serve run`` on a local Ray) runs
every section, each in a process of its own, or says why not, its answers are right, and
its rows carry what the GPU run reports; and the pure parts of benchmarks/served.py.
(tests/benchmarks/test_device_sections.py rehearses its sections' failures.)"""

from __future__ import annotations

import json

import pytest

from benchmarks import device, device_apps, gpu_served, served, switches
from benchmarks.device_apps import MODES


@pytest.fixture(scope="module")
def smoke(cpu_smoke):
    env = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    before = served.haproxy_pids()
    done, out = cpu_smoke("gpu_served", timeout=1200, **env)
    return done, out, json.loads((out / "gpu_served.json").read_text()), before


def test_cpu_smoke_leaves_no_haproxy_running(smoke):
    """Its HAProxy section's ``serve run`` stops the HAProxy it started, which would
    otherwise keep its fixed ports and stop the next HAProxy on the machine."""
    *_, before = smoke
    assert served.haproxy_pids() <= before


def test_cpu_smoke_runs_every_section_or_says_why_not(smoke):
    done, out, report, _ = smoke
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]
    assert done.stdout.startswith("versions: python ")
    assert (report["mode"], report["preset"], report["exit_code"]) == ("cpu-smoke", "tiny", 0)
    assert list(report["sections"]) == list(gpu_served.SECTIONS)
    assert report["driver_touched_cuda"] is False  # only the sections' processes may
    for name, section in report["sections"].items():
        status = section["status"]
        assert status == "pass" or (status.startswith("skipped: ") and len(status) > 12), (
            name,
            status,
            section.get("error"),
        )
        assert all(c["status"] == "pass" for c in section["checks"]), (name, section["checks"])
    assert len(list(out.iterdir())) <= 8  # what the device machine sends back
    markdown = (out / "gpu_served.md").read_text()
    assert "## http, cache off: pass" in markdown


def test_cpu_smoke_answers_match_the_in_process_encoder(smoke):
    """Every app's answers are checked against the encoder, behind each ingress that ran;
    every request of every window answered 200; every pushed part reached the sink and
    every encoder-cache file is complete."""
    _, _, report, _ = smoke
    sections = report["sections"]
    names = {c["name"] for s in sections.values() for c in s["checks"] if c["status"] == "pass"}
    assert {"/off answers match the encoder", "/on answers match the encoder"} <= names
    assert "every part's frames reached the sink" in names
    assert "every file complete, no temporary left" in names
    http = sections["http, cache off"]["checks"]
    assert [c["errors"] for c in http if c["name"] == "every request answered 200"] == [0]


def tower_results(report: dict) -> dict:
    """Every tower section's results, the last one's summary last (the run's)."""
    sections = report["sections"]
    return {k: v for mode in MODES for k, v in sections[f"tower, {mode}"]["results"].items()}


def test_cpu_smoke_rows_carry_rates_ratios_and_the_rank_inside(smoke):
    _, _, report, _ = smoke
    sections = report["sections"]
    tower = tower_results(report)
    square = tower["tower, square set"]["images_per_s"]
    assert square > 0
    assert tower["tower, mixed set"]["images_per_s"] > 0
    assert sections["batcher"]["results"]["setup"]["execution"]["mode"] in switches.MODES
    off = sections["http, cache off"]["results"]
    assert off["tower denominators"]["square"] == tower["tower, square set"]
    for per in gpu_served.SMOKE.per_request:
        for clients in gpu_served.SMOKE.clients:
            row = off[f"{per} per request, {clients} clients"]
            assert row["errors"] == 0
            assert row["images_per_s"] > 0
            assert row["of_tower"] == pytest.approx(row["images_per_s"] / square, rel=2e-3)
            rank = row["rank"]
            assert rank["images"] > 0
            stages = ("queue_ms", "decode_preprocess_ms", "to_device_ms", "forward_ms", "copy_ms")
            assert all(rank[s] >= 0 for s in stages)
            assert 0 < rank["gpu_busy"] <= 1.5  # forward time over the window (wall on CPU)
            assert rank["hedged"] == rank["redispatched"] == 0
    assert any(key.startswith("mixed set") for key in off)
    cached = sections["http, every image cached"]["results"]
    rows = [row for row in cached.values() if isinstance(row, dict) and "rank" in row]
    assert len(rows) == 4
    assert all(row["rank"]["images"] == 0 and row["images_per_s"] > 0 for row in rows)
    for name in ("sglang parts", "vllm files"):
        results = sections[name]["results"].values()
        rows = [r for r in results if isinstance(r, dict) and "rank" in r]
        assert len(rows) == 2, name  # cache off, every image cached
        assert all(r["images_per_s"] > 0 and r["mb_per_s"] > 0 for r in rows), name
    batcher = sections["batcher"]["results"]
    assert all(batcher[f"concurrency {c}"]["of_tower"] > 0 for c in gpu_served.SMOKE.clients)


def test_cpu_smoke_measures_the_tower_in_every_mode_it_can_run(smoke):
    """Eager and compiled on CPU, each in a section of its own, on the FLOP batch and both
    sets; graphs and eager on varlen say why not; the ratios' denominators are the fastest
    mode's rates; the bucket check ran on the uncaptured buckets."""
    _, _, report, _ = smoke
    tower = tower_results(report)
    by_mode = tower["tower by mode"]
    assert by_mode["graphs"]["status"] == "not possible here: " + GRAPHS_ON_CPU
    assert by_mode["eager, varlen"]["status"].startswith("not possible here: attention_kernel")
    name = gpu_served.SMOKE.flops_mix[0]
    for mode in ("eager", "compiled"):
        own = report["sections"][f"tower, {mode}"]["results"]
        assert by_mode[mode]["status"] == "ok"
        assert own[f"{mode}, {name}"]["patches"] == 16 * 64
        assert own[f"{mode}, {name}"]["tflops"] > 0
        assert by_mode[mode][f"{name} tflops"] == own[f"{mode}, {name}"]["tflops"]
    assert by_mode["compiled"]["build_s"] > 0
    for kind in ("square", "mixed"):
        rates = {mode: by_mode[mode][f"{kind} images_per_s"] for mode in ("eager", "compiled")}
        best = tower[f"tower, {kind} set"]
        assert best["images_per_s"] == max(rates.values())
        assert rates[best["mode"]] == best["images_per_s"]
    graphs = report["sections"]["tower, graphs"]
    assert graphs["status"] == "pass", graphs.get("error")
    checks = {c["name"]: c["status"] for c in graphs["checks"]}
    assert checks == {"every bucket (uncaptured) matches eager: small, large, small again": "pass"}
    rows = graphs["results"]["graphs vs eager, small-large-small"]
    assert list(rows) == ["bucket 512", "bucket 1024", "bucket 2048"]
    for row in rows.values():
        assert (row["small_equal"], row["finite"], row["in_its_bucket"]) == (True, True, True)
        assert min(row[f"{b} cosine"] for b in ("small", "large", "small again")) >= 0.999
    assert graphs["results"]["buckets after the check"]["eager_batches"] == 0


def test_cpu_smoke_starts_every_app_before_any_window(smoke):
    """One ``serve run`` with /off, /on and the 4 CPU variants, all live before the first
    window; each rank's execution as its /v1/info reports it."""
    _, _, report, _ = smoke
    start = report["sections"]["serve run (proxy)"]
    assert start["status"] == "pass", start.get("error")
    apps = ["off", "on", *(f"{m}-{d}" for m in ("eager", "compiled") for d in switches.DECODES)]
    assert sorted(start["results"]["apps"]) == sorted(apps)
    assert sorted(start["results"]["ready_s"]) == sorted(apps)
    modes = {app: row["mode"] for app, row in start["results"]["execution by app"].items()}
    assert modes == {app: app.split("-")[0] if "-" in app else "eager" for app in apps}
    checks = [c for c in start["checks"] if c["name"] == "every app live before any window"]
    assert [c["status"] for c in checks] == ["pass"]


def test_cpu_smoke_serves_every_cpu_variant_side_by_side(smoke):
    """A row per window of each of the 4 CPU variants, each with its answers checked, its
    rank running the mode asked for and decoding where asked; graphs' rows say why not."""
    _, out, report, _ = smoke
    section = report["sections"]["switches"]
    assert section["status"] == "pass", section.get("error")
    passed = {c["name"] for c in section["checks"] if c["status"] == "pass"}
    results, variants = section["results"], section["results"]["variants"]
    served = [f"{mode}-{decode}" for mode in ("eager", "compiled") for decode in switches.DECODES]
    assert sorted(variants) == sorted([*served, "graphs-threads", "graphs-processes"])
    for decode in switches.DECODES:
        assert variants[f"graphs-{decode}"] == {"status": "not possible here: " + GRAPHS_ON_CPU}
    (per, clients), (one, many) = gpu_served.SMOKE.switch_windows
    labels = {f"{per} x {clients}": "square", f"{one} x {many}": "square"}
    labels[f"mixed 8 x {clients}"] = "mixed"
    tower = tower_results(report)
    for name in served:
        mode, decode = name.split("-")
        assert f"/{name} answers match the encoder" in passed
        row = variants[name]
        assert (row["status"], row["mode"], row["decode"]) == ("ok", mode, decode)
        assert row["decode_workers"] == (1 if decode == "processes" else 0)
        assert row["build_s"] > 0 if mode == "compiled" else row["build_s"] == 0
        for label, kind in labels.items():
            window = results[f"{name}, {label}"]
            assert window["errors"] == 0, (name, label)
            assert window["images_per_s"] > 0, (name, label)
            denominator = tower[f"tower, {kind} set"]["images_per_s"]
            assert window["of_tower"] == pytest.approx(window["images_per_s"] / denominator, 2e-3)
            own = tower["tower by mode"][mode][f"{kind} images_per_s"]
            assert window["of_own_mode_tower"] == pytest.approx(window["images_per_s"] / own, 2e-3)
            rank = window["rank"]
            assert rank["images"] > 0
            assert rank["forward_wait_ms"] >= 0
            assert 0 < rank["gpu_busy"] <= 1.5
            assert row[f"{label} of_tower"] == window["of_tower"]
        first = results[f"{name}, {per} x {clients}"]["rank"]
        assert row["forward_of_tower"] == first["forward_of_tower"] > 0
        assert results["execution after the windows"][name]["mode"] == mode
    assert {"every variant served and answered", "every request answered 200"} <= passed
    assert "## switches: pass" in (out / "gpu_served.md").read_text()


GRAPHS_ON_CPU = "CUDA graphs need a CUDA device, got device 'cpu'"


def test_rolling_deadlines_give_each_section_its_share_and_what_was_left():
    shares = {"a": 10.0, "b": 20.0, "c": 5.0}
    deadlines = device.Rolling(shares, ["a", "c"])  # b not run: its share does not count
    assert list(deadlines) == ["a", "c"]
    assert deadlines["a"] == pytest.approx(10.0, abs=1.0)
    assert deadlines["c"] == pytest.approx(15.0, abs=1.0)  # a's share unused so far
    deadlines.started -= 12.0  # a took 12 s: c still has its own share
    assert deadlines["c"] == 5.0


def test_every_gpu_section_has_a_share_and_the_shares_fit_the_budget():
    """The GPU's default run, shutdown included, fits 420 s: a rerun fits the 15 minutes a
    GPU is lent; --cpu-smoke's fits its own budget."""
    assert gpu_served.FULL.budget_s <= 420
    for plan in (gpu_served.FULL, gpu_served.SMOKE):
        assert list(plan.shares) == list(gpu_served.SECTIONS)
        default = [name for name in gpu_served.SECTIONS if name not in plan.optional]
        planned = sum(plan.shares[name] for name in default)
        assert planned + device.Report.RESERVE_S + gpu_served.SHUTDOWN_S <= plan.budget_s
    assert gpu_served.SMOKE.optional == ()  # CI runs every section


@pytest.mark.parametrize("apps", [2, 3, 6, 8])
def test_the_gpu_shares_of_the_ranks_fit_one_gpu(apps):
    share = device_apps.gpu_share(apps)
    assert apps * share <= 1.0
    assert share > 1 / apps - 1e-4


def test_the_gpu_runs_apps_validate_and_fit_the_machine(tmp_path):
    """The proxy's run on the GPU: /off, /on and the 6 variants, each valid ``AppArgs``
    running the mode and decode its name says; their GPU shares add up to at most one GPU
    and their CPUs to at most the machine's 16. (Every mode counts as possible here, as on
    the GPU machine: the driver reads which are from its probe.)"""
    from deployments.args import AppArgs

    ctx = device_apps.Context(gpu_served.FULL, tmp_path, tmp_path, unsupported={})
    ctx.variant_apps = switches.variant_apps(ctx)
    config = served.served_config(gpu_served.CONFIG, 8123, device_apps.run_apps(ctx, "proxy"))
    apps = {app["name"]: AppArgs.model_validate(app["args"]) for app in config["applications"]}
    variants = [f"{m}-{d}" for m in switches.MODES for d in switches.DECODES]
    assert sorted(apps) == sorted(["off", "on", *variants])
    for name in variants:
        mode, decode = name.split("-")
        assert (apps[name].model.execution, apps[name].ranks.batching.decode) == (mode, decode)
        assert apps[name].ranks.cache_bytes == apps[name].ingress.cache_bytes == 0
    assert apps["off"].model.execution == apps["on"].model.execution == "auto"
    assert sum(a.ranks.actor_options.num_gpus for a in apps.values()) <= 1.0
    cpus = [
        a.ranks.actor_options.num_cpus + a.ingress.replicas * a.ingress.actor_options.num_cpus
        for a in apps.values()
    ]
    assert sum(cpus) <= 16
    ctx.put_tower("graphs", {"error": "RuntimeError: capture failed"})  # not started; the rest are
    assert "graphs-threads" not in device_apps.run_apps(ctx, "proxy")
    ctx.write("server_modes", {"off": "compiled"})  # HAProxy's apps run the mode /off ran
    haproxy = device_apps.run_apps(ctx, "haproxy")
    assert sorted(haproxy) == ["off", "on"]
    assert {args["execution"] for args in haproxy.values()} == {"compiled"}


def test_served_config_turns_the_shipped_config_into_apps_the_app_accepts():
    """configs/k3-8gpu.yaml as two apps on a loopback port; each app's args, with the
    benchmark's changes written by their flat names, validate as ``AppArgs``."""
    from deployments.args import AppArgs

    changes = {"checkpoint": "tiny", "dp_size": 1, "ec_root": "/tmp"}
    changes |= {"feature_cache_bytes": 0, "ingress_cache_bytes": 0}
    config = served.served_config(gpu_served.CONFIG, 8123, {"off": changes, "on": {"dp_size": 1}})
    assert config["http_options"]["host"] == "127.0.0.1"
    assert config["http_options"]["port"] == 8123
    apps = config["applications"]
    assert [(a["name"], a["route_prefix"]) for a in apps] == [("off", "/off"), ("on", "/on")]
    off, on = (AppArgs.model_validate(app["args"]) for app in apps)
    assert off.model_dump() != on.model_dump()
    dumped = json.dumps(off.model_dump(), default=str)
    assert '"tiny"' in dumped
    assert '"/tmp"' in dumped


def test_merged_keeps_what_the_top_does_not_change():
    base = {"a": {"b": 1, "c": {"d": 2}}, "e": [1]}
    top = {"a": {"c": {"f": 3}}, "e": [2]}
    assert served.merged(base, top) == {"a": {"b": 1, "c": {"d": 2, "f": 3}}, "e": [2]}
    assert base == {"a": {"b": 1, "c": {"d": 2}}, "e": [1]}  # not changed in place


def test_inside_rank_gives_time_per_image_and_the_gpu_busy_share():
    """10 images in 2 batches over a 2 s window: 0.2 s of forward, 0.1 s of queueing..."""
    zero = dict.fromkeys(served.RANK_COUNTERS + served.FAILOVER_COUNTERS, 0.0)
    zero |= {"unavailable_errors": 0.0, "has_stage_counters": 1.0}
    after = zero | {"forwarded": 10.0, "batches": 2.0, "forward_s": 0.2, "queue_s": 0.1}
    after |= {"host_s": 0.05, "device_s": 0.01, "copy_s": 0.02, "store_s": 0.03}
    after |= {"hedged_images": 1.0}
    got = served.inside_rank(zero, after, wall_s=2.0, tower_ips=100.0, decode_ms=1.5)
    assert got["images"] == 10
    assert got["per_batch"] == 5
    assert got["hedged"] == 1
    assert got["gpu_busy"] == pytest.approx(0.1)
    assert got["forward_ms"] == pytest.approx(20.0)
    assert got["forward_of_tower"] == pytest.approx(2.0)  # the tower takes 10 ms an image
    want = {"queue_ms": 10.0, "decode_preprocess_ms": 5.0, "to_device_ms": 1.0}
    want |= {"copy_ms": 2.0, "store_ms": 3.0, "decode_ms": 1.5}
    assert {k: pytest.approx(v) for k, v in want.items()} == {k: got[k] for k in want}
    older = after | {"has_stage_counters": 0.0}  # a rank without the stage counters
    assert "queue_ms" not in served.inside_rank(zero, older, 2.0, 100.0, 1.5)
    no_tower = served.inside_rank(zero, after, 2.0, None, None)  # no tower figure measured
    assert no_tower["forward_of_tower"] is None
    assert no_tower["forward_ms"] == pytest.approx(20.0)
