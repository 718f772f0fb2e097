"""Short CI variant of the loopback load test (benchmarks/bench_load.py: 16 clients x 60 s).

4 clients for 15 s of mixed sizes, image counts, wire formats and repeats
against the shared dp-2 app, and on until they have sent 20 requests (a busy machine
answers fewer in 15 s): every answer is checked against the in-process features of
its own images.
"""

from __future__ import annotations

from benchmarks.bench_load import run_load

REQUESTS = 20


def test_load_loses_nothing_and_answers_right(deploy):
    url = deploy(2)
    figures = run_load(url, clients=4, seconds=15, seed=1, at_least=REQUESTS)
    print(figures)
    assert figures["problems"] == [], figures
    assert (figures["lost"], figures["wrong"], figures["unexpected_5xx"]) == (0, 0, 0), figures
    assert figures["unexpected_4xx"] == 0, figures
    assert figures["requests_ok"] >= REQUESTS, figures  # every one answered right
