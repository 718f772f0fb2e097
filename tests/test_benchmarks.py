"""The benchmark modules stay importable and their pure parts stay right (no timings)."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks import bench_assign, bench_handoff, bench_serve
from deployments.wire import safetensors_body
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
    assert bench_serve.knee([(i, 0, p, 0) for i, p in enumerate(p95s)]) == knee


def test_handoff_counts_only_the_feature_tensors_of_a_body():
    features = [np.zeros((3, 8), np.uint16), np.zeros((5, 8), np.uint16)]
    tensors = {f"features.{i}": (a, "BF16") for i, a in enumerate(features)}
    tensors["grid_thw.0"] = (np.zeros((1, 3), np.int64), "I64")
    body = safetensors_body(tensors, {"model": "m"})
    assert bench_handoff.feature_bytes(body) == (3 + 5) * 8 * 2
