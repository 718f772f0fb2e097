"""Throughput features over real HTTP: cross-request batching, the feature cache and its
routing, fitted costs, load-aware assignment with two ingress replicas, thread count.

Correctness only (never timings): counters in /v1/info prove what a rank did, and
where work must overlap a test holds a rank's forward (controlled.py) instead of
relying on a time window.
"""

from __future__ import annotations

import concurrent.futures as cf
import time

import numpy as np
import pytest
import ray
import requests
from controlled import Switchboard, controlled_factory
from images import image_bytes
from ray import serve
from serve_helpers import (
    app_args,
    b64,
    decode_features,
    encode,
    rank_calls,
    replica_actor,
    replica_actor_name,
)

from deployments.app import bind_app
from deployments.handles import IngressCache
from kimi_encoder.assign import assign_owners
from kimi_encoder.cost import CostModel


def info(url: str) -> dict:
    return requests.get(f"{url}/v1/info", timeout=30).json()


def ranks(url: str) -> list[dict]:
    return info(url)["ranks"]


def items_of(*images: bytes) -> list[dict]:
    return [{"type": "image", "image": b64(b)} for b in images]


def fresh(seed: int, width: int = 80, height: int = 60) -> bytes:
    """An image no other test sends (seeds from 1000 up)."""
    return image_bytes("RGB", (width, height), 1000 + seed)


@pytest.fixture(scope="module")
def board(serve_url):
    return Switchboard.remote()


@pytest.fixture(scope="module")
def apps(serve_url, board):
    """Two apps of this module whose ranks the test can hold (controlled.py), removed when
    it ends (one rank reserves both logical CPUs)."""
    created = []

    def run(name: str, args) -> str:
        serve.run(bind_app(args, controlled_factory(board)), name=name, route_prefix=f"/{name}")
        created.append(name)
        return f"{serve_url}/{name}"

    yield run
    for name in created:
        serve.delete(name)


@pytest.fixture(scope="module")
def batching_url(apps) -> str:
    """dp 1, two CPUs for the rank, no cache; held calls are not hedged."""
    args = app_args(
        dp_size=1,
        ranks={"actor_options": {"num_cpus": 2}, "cache_bytes": 0},
        dispatch={"slow_after_s": 60},
    )
    return apps("batching", args)


@pytest.fixture(scope="module")
def two_ingress_url(apps) -> str:
    """dp 2 behind two ingress replicas, owners by patch count, loads polled per request."""
    args = app_args(
        dp_size=2,
        ingress={"replicas": 2},
        ranks={"cache_bytes": 0},
        dispatch={
            "cost_model": "patches",
            "load_report_interval_ms": 0,
            "slow_after_s": 60,  # rank 0 is held on purpose: not hedged
            "route_timeout_s": 30,  # nor hedged or silent when a busy machine routes slowly
        },
    )
    return apps("two_ingress", args)


def wait_outstanding(url: str, rank: int, images: int) -> None:
    """Until ``rank`` reports ``images`` images queued or running (its load report)."""
    deadline = time.monotonic() + 30
    while ranks(url)[rank]["outstanding"]["images"] != images:
        assert time.monotonic() < deadline, ranks(url)[rank]["outstanding"]
        time.sleep(0.02)


@pytest.fixture(scope="module")
def cache_url(deploy) -> str:
    """dp 2 with the defaults: fitted costs, a feature cache, cache affinity."""
    return deploy(2, "cached", ranks={"cache_bytes": 64 << 20}, dispatch={"cost_model": "fitted"})


def test_concurrent_requests_are_batched_and_match_unbatched(batching_url, board, reference):
    """Four requests that queue behind a running forward share the next one."""
    images = [fresh(i, 60 + 10 * i, 50 + 5 * i) for i in range(4)]
    before = ranks(batching_url)[0]
    ray.get(board.set.remote(0, "hold"))
    with cf.ThreadPoolExecutor(5) as pool:
        blocker = pool.submit(encode, batching_url, items_of(fresh(9, 50, 40)))
        ray.get(board.wait_held.remote(0), timeout=30)
        pending = [pool.submit(encode, batching_url, items_of(b)) for b in images]
        wait_outstanding(batching_url, 0, 5)  # the held one and the four queued behind it
        ray.get(board.set.remote(0, "run"))
        responses = [f.result() for f in pending]
        assert blocker.result().status_code == 200
    after = ranks(batching_url)[0]
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    assert after["forwarded"] - before["forwarded"] == 5
    assert after["batches"] - before["batches"] == 2  # the blocker's, then all four together
    assert after["max_batch_calls"] >= 4
    for data, response in zip(images, responses, strict=True):
        (item,) = response.json()["items"]
        want = reference.encode([reference.plan(data)])[0].numpy()
        np.testing.assert_allclose(decode_features(item), want, rtol=0, atol=1e-5)


def test_rank_uses_its_cpu_allotment_as_torch_threads(batching_url, deploy):
    assert ranks(batching_url)[0]["num_threads"] == 2
    assert [r["num_threads"] for r in ranks(deploy(2))] == [1, 1]  # num_cpus 0 -> 1 thread


def test_fitted_cost_model_is_exposed_and_used(cache_url):
    body = info(cache_url)
    for rank in body["ranks"]:
        fit = rank["cost_model"]
        assert min(fit["a"], fit["b"], fit["c"]) >= 0
        assert fit["grids"] == [8, 16, 32]
    sizes = [(700, 520), (300, 200), (200, 150), (90, 60), (60, 40)]
    images = [fresh(10 + i, w, h) for i, (w, h) in enumerate(sizes)]
    response = encode(cache_url, items_of(*images))
    assert response.status_code == 200, response.text
    model = info(cache_url)["assignment"]["cost_model"]
    assert model["source"] == "fitted"
    cost = CostModel(model["a"], model["b"], model["c"])
    got = response.json()["items"]
    costs = [cost(int(np.prod(item["grid_thw"]))) for item in got]
    assert [item["owner_rank"] for item in got] == assign_owners(costs, 2)


def test_repeated_image_is_a_hit_on_the_rank_holding_it(cache_url):
    image = fresh(20, 300, 200)
    first = encode(cache_url, items_of(fresh(21, 640, 480), image)).json()["items"]
    holder = first[1]["owner_rank"]
    before = ranks(cache_url)
    again = encode(cache_url, items_of(image)).json()["items"][0]
    after = ranks(cache_url)
    assert again["owner_rank"] == holder  # would be rank 0 by load alone when holder is 1
    keys = ("cache_hits", "preprocessed", "by_digest", "not_cached")
    delta = {k: after[holder][k] - before[holder][k] for k in keys}
    # Sent without its file bytes (the ingress knew the holder), found by its digest.
    assert delta == {"cache_hits": 1, "preprocessed": 0, "by_digest": 1, "not_cached": 0}
    assert after[holder]["forwarded"] == before[holder]["forwarded"]
    assert again["data"] == first[1]["data"]


def test_an_image_sent_by_digest_that_the_rank_lost_is_sent_again_with_its_bytes(deploy):
    """A rank whose cache no longer holds an image it answered (here: a cache smaller
    than the features, so nothing stays) answers it missing; the ingress sends it again
    with its bytes in the same request, and the answer is the first one's."""
    url = deploy(2, "tiny_cache", ranks={"cache_bytes": 1024})
    image = fresh(60, 160, 120)
    first = encode(url, items_of(image))
    assert first.status_code == 200, first.text
    (item,) = first.json()["items"]
    tokens, hidden = item["shape"]
    assert tokens * hidden * 4 > 1024  # the precondition: too big to be cached
    before = ranks(url)
    again = encode(url, items_of(image))
    after = ranks(url)
    assert again.status_code == 200, again.text
    assert again.json()["items"][0]["data"] == item["data"]
    keys = ("by_digest", "not_cached", "cache_hits", "forwarded")
    delta = {k: sum(a[k] - b[k] for a, b in zip(after, before, strict=True)) for k in keys}
    assert delta == {"by_digest": 1, "not_cached": 1, "cache_hits": 0, "forwarded": 1}


def test_duplicates_in_one_request_are_encoded_once(cache_url):
    image = fresh(30, 200, 120)
    before = ranks(cache_url)
    body = encode(cache_url, items_of(image, image, image)).json()
    after = ranks(cache_url)
    forwarded = sum(a["forwarded"] - b["forwarded"] for a, b in zip(after, before, strict=True))
    assert forwarded == 1
    assert len({item["data"] for item in body["items"]}) == 1
    assert len({item["owner_rank"] for item in body["items"]}) == 1


def test_other_backend_misses_the_cache(cache_url):
    """The backend is part of the cache key (cpu and gpu pixels may differ on a GPU); the
    grid stays the same. Keys of transposed and re-backgrounded images: test_cache.py."""
    image = fresh(50, 150, 30)
    before = ranks(cache_url)
    cpu = encode(cache_url, items_of(image)).json()["items"]
    gpu = encode(cache_url, items_of(image), backend="gpu").json()["items"]
    after = ranks(cache_url)
    hits = sum(a["cache_hits"] - b["cache_hits"] for a, b in zip(after, before, strict=True))
    assert hits == 0
    assert gpu[0]["grid_thw"] == cpu[0]["grid_thw"]


KEPT_SIZE = (160, 120)  # every image of the kept-features tests: equal feature bytes


@pytest.fixture(scope="module")
def kept_url(deploy, reference) -> str:
    """dp 2 whose ingress holds the ranks' cached features, room for two images'."""
    item = reference.plan(fresh(70, *KEPT_SIZE))
    one = reference.vision.num_tokens(item.grid) * reference.vision.text_hidden_size * 4
    return deploy(2, "kept", ranks={"cache_bytes": 64 << 20}, ingress={"cache_bytes": 2 * one})


def test_the_ingress_answers_a_repeated_image_from_the_features_it_kept(kept_url, reference):
    a, b, c = (fresh(70 + i, *KEPT_SIZE) for i in range(3))
    first = encode(kept_url, items_of(a, b))
    assert first.status_code == 200, first.text
    calls, kept = rank_calls(kept_url), info(kept_url)["ingress_cache"]
    again = encode(kept_url, items_of(b, a))  # read b, then a: a is the most recent
    assert again.status_code == 200, again.text
    assert rank_calls(kept_url) == calls  # no rank was asked
    assert info(kept_url)["ingress_cache"]["hits"] - kept["hits"] == 2
    one, two = first.json()["items"]
    for got, want in zip(again.json()["items"], (two, one), strict=True):
        assert (got["data"], got["owner_rank"], got["shape"]) == (
            want["data"],
            want["owner_rank"],
            want["shape"],
        )
    expected = reference.encode([reference.plan(a)])[0].float().numpy()
    np.testing.assert_allclose(decode_features(again.json()["items"][1]), expected, atol=1e-5)

    # c is encoded and kept; the bound (two images) drops the least recently read, b.
    assert encode(kept_url, items_of(c)).status_code == 200
    state = info(kept_url)["ingress_cache"]
    assert (state["entries"], state["evictions"] - kept["evictions"]) == (2, 1)
    assert state["bytes"] <= state["max_bytes"]
    calls = rank_calls(kept_url)
    both = encode(kept_url, items_of(a, b)).json()["items"]  # a kept, b sent to a rank
    assert [item["data"] for item in both] == [one["data"], two["data"]]
    assert sum(rank_calls(kept_url)) == sum(calls) + 1

    # Another wire dtype is another entry: a float32 one never answers bfloat16.
    calls = rank_calls(kept_url)
    (bf16,) = encode(kept_url, items_of(a), feature_dtype="bfloat16").json()["items"]
    assert sum(rank_calls(kept_url)) == sum(calls) + 1
    assert bf16["dtype"] == "bfloat16"
    np.testing.assert_allclose(decode_features(bf16), expected, rtol=2**-8, atol=1e-6)


def actors() -> list[dict]:
    return list(ray._private.state.actors().values())


def test_kept_features_of_a_dead_rank_answer_correctly(kept_url):
    """Features the ingress holds outlive their rank: a repeated image is answered from
    them, unchanged, after the rank that encoded it has died, without a rank call."""
    image = fresh(80, *KEPT_SIZE)
    (first,) = encode(kept_url, items_of(image)).json()["items"]
    owner = first["owner_rank"]
    name = replica_actor_name("kept", owner)
    before = info(kept_url)["ingress_cache"]
    ray.kill(replica_actor("kept", owner), no_restart=True)
    deadline = time.monotonic() + 30
    while any(a["Name"] == name and a["State"] != "DEAD" for a in actors()):
        assert time.monotonic() < deadline, f"{name} still alive"
        time.sleep(0.05)
    again = encode(kept_url, items_of(image))
    assert again.status_code == 200, again.text
    assert again.json()["items"][0]["data"] == first["data"]
    assert info(kept_url)["ingress_cache"]["hits"] == before["hits"] + 1


def test_kept_features_outlive_the_process_that_wrote_them(serve_url):
    """An array read from the object store and kept stays readable, unchanged, once the
    process that owned its object has died and no ref to it is left; the cache hands
    out the same array with the rank that encoded it, and bounds what it holds."""

    @ray.remote(num_cpus=0)
    class Writer:
        def put(self, n: int) -> list:
            return [ray.put(np.arange(n, dtype=np.float32))]

    writer = Writer.remote()
    (ref,) = ray.get(writer.put.remote(1 << 16))
    array = ray.get(ref)
    assert not array.flags.writeable  # a view of the object in the store
    cache = IngressCache(array.nbytes)
    cache.keep("kept", array, rank=1)
    del ref, array
    ray.kill(writer, no_restart=True)
    ray.get([ray.put(np.ones(4 << 20, np.uint8)) for _ in range(4)])  # may take freed memory
    ((position, (kept, rank)),) = cache.lookup(["other", "kept"]).items()
    assert (position, rank) == (1, 1)
    np.testing.assert_array_equal(kept, np.arange(1 << 16, dtype=np.float32))
    cache.keep("more", np.zeros(1, np.float32), rank=0)  # over the bound: "kept" goes
    assert cache.lookup(["kept"]) == {}
    state = cache.info()
    assert (state["entries"], state["bytes"], state["evictions"]) == (1, 4, 1)


def test_load_aware_assignment_with_two_ingress_replicas(two_ingress_url, board):
    big = fresh(40, 700, 520)
    smalls = [fresh(41 + i, 60, 40) for i in range(4)]
    ray.get(board.set.remote(0, "hold"))  # the big image stays outstanding on rank 0
    with cf.ThreadPoolExecutor(5) as pool:
        first = pool.submit(encode, two_ingress_url, items_of(big))
        ray.get(board.wait_held.remote(0), timeout=30)
        wait_outstanding(two_ingress_url, 0, 1)  # what the ingress replicas' plans read
        later = [pool.submit(encode, two_ingress_url, items_of(s)) for s in smalls]
        answers = [f.result() for f in later]  # answered by rank 1 while rank 0 holds
        ray.get(board.set.remote(0, "run"))
        answers.insert(0, first.result())
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
    owners = [a.json()["items"][0]["owner_rank"] for a in answers]
    # Patch counts alone would put every single-image request on idle rank 0; whichever
    # ingress replica served a small request, it saw the big image outstanding on rank 0.
    assert owners == [0, 1, 1, 1, 1]


def test_two_ingress_replicas_balance_concurrent_skewed_requests(two_ingress_url, board):
    """Twelve requests in flight together, each one large and two small images, through
    both ingress replicas, while the ranks hold their work: each replica counts what the
    other sent from the ranks' load reports, so the ranks end up as balanced as one
    replica would make them (largest-first to the least loaded, over all the images):
    within 10%. Each request is sent once the ranks report the previous one's images
    (plans made at the same instant on two replicas cannot see each other's work until
    the ranks report it, docs/api.md)."""
    sizes = [(700, 520), (90, 60), (60, 40)]
    requests_ = [[fresh(300 + 3 * r + k, *sizes[k]) for k in range(3)] for r in range(12)]
    for rank in (0, 1):
        ray.get(board.set.remote(rank, "hold"))
    try:
        with cf.ThreadPoolExecutor(12) as pool:
            pending = []
            for r in requests_:
                pending.append(pool.submit(encode, two_ingress_url, items_of(*r)))
                deadline = time.monotonic() + 60
                while sum(
                    rank["outstanding"]["images"] for rank in ranks(two_ingress_url)
                ) < 3 * len(pending):
                    assert time.monotonic() < deadline, ranks(two_ingress_url)
                    time.sleep(0.02)
            loads = [r["outstanding"]["patches"] for r in ranks(two_ingress_url)]
            for rank in (0, 1):
                ray.get(board.set.remote(rank, "run"))
            answers = [f.result() for f in pending]
    finally:
        for rank in (0, 1):
            ray.get(board.set.remote(rank, "run"))
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
    patches = [int(np.prod(i["grid_thw"])) for a in answers for i in a.json()["items"]]
    one_replica = assign_owners(patches, 2)
    best = max(sum(p for p, o in zip(patches, one_replica, strict=True) if o == r) for r in (0, 1))
    print(f"\nrank loads with two ingress replicas {loads}; one replica's makespan {best}")
    assert max(loads) <= 1.1 * best
