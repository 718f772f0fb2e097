"""How much faster a cache hit is than a miss, and how often a skewed stream hits.

    python -m benchmarks.bench_cache [--quick]

One served app (dp 1, feature cache on): each of a few 640x480 images is sent
once (a miss) and then three times (hits, the best counted); then a Zipf(1.1)
stream of single-image requests over a catalog of 50 images, whose hit rate the
rank's own counters give (``/v1/info``).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import numpy as np

from .common import Section, ratio, spread, table
from .inputs import image
from .page import standalone
from .serving import MIX, Cluster, Encode, Http, bench_args, bind, json_body


@dataclass(frozen=True)
class Settings:
    preset: str
    images: int
    zipf_draws: int

    @classmethod
    def of(cls, quick: bool) -> Settings:
        return cls("tiny", 4, 60) if quick else cls("small", 8, 200)


def sections(quick: bool) -> list[Section]:
    s = Settings.of(quick)
    with Cluster() as cluster:
        client = Http(cluster.port)
        prefix = cluster.deploy(
            "cached", bind(bench_args(s.preset, 1, feature_cache_bytes=256 << 20))
        )
        encode = Encode(client, prefix, [])

        def latency(images: list[bytes]) -> float:
            body = json_body(images)
            start = time.perf_counter()
            client.post(encode.path, body, "application/json")
            return time.perf_counter() - start

        miss, hit = [], []
        for k in range(s.images):  # miss, then hit, image after image
            images = [image(640, 480, seed=5000 + k)]
            miss.append(latency(images) * 1e3)
            hit.append(min(latency(images) for _ in range(3)) * 1e3)
        catalog = [image(*MIX[k % len(MIX)], seed=6000 + k) for k in range(50)]
        rng = np.random.default_rng(0)
        draws = [min(int(rng.zipf(1.1)), len(catalog)) - 1 for _ in range(s.zipf_draws)]
        before = encode.info()["ranks"][0]["cache_hits"]
        for d in draws:
            latency([catalog[d]])
        hits = encode.info()["ranks"][0]["cache_hits"] - before
        cluster.delete("cached")
    rows = [
        ["first request (miss), ms", spread(miss).fmt(1)],
        ["same image again (hit, best of 3), ms", spread(hit).fmt(1)],
        ["**speed-up** (per image: miss / hit)", f"**{ratio(miss, hit).fmt(1, 'x')}**"],
        [
            f"Zipf(1.1) over 50 images, {len(draws)} requests: hit rate",
            f"{hits / len(draws):.2f} (distinct: {len(set(draws))})",
        ],
    ]
    return [
        Section(
            "Feature cache (target: hit >= 10x faster)",
            "python -m benchmarks.bench_cache",
            [
                f"Preset {s.preset}, dp 1, one 640x480 image per request; {s.images} images, "
                "each sent once (a miss) and then three times (hits).",
                table(["measure", "value"], rows),
            ],
        )
    ]


def main(argv: list[str] | None = None) -> int:
    return standalone(__doc__, lambda a: sections(a.quick), argv)


if __name__ == "__main__":
    sys.exit(main())
