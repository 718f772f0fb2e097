"""Our side of the interop tests: what kimi_encoder sends, built from seeded images.

Runs under the project's Python (``KIMI_ENCODER_PYTHON``), so the engines'
code reads bytes written by the torch and pyzmq the service really uses.

    produce.py frames OUT --dtype D --num-parts N
    produce.py push OUT --dtype D --num-parts N --rid R (--port P | --receive-url H:P ...)
    produce.py ec OUT ROOT --dtype D

Each writes OUT/spec.json (grids, sizes, token counts, parts) and
OUT/expected.safetensors (the features sent, in their dtype).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import itertools
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/images.py

from images import image_bytes

from kimi_encoder.config import PreprocessConfig, VisionConfig
from kimi_encoder.engines.media import FetchPolicy
from kimi_encoder.engines.sglang import (
    EncodeRequest,
    ReceiverRegistry,
    ReceiveUrlRequest,
    deliver,
    load_images,
)
from kimi_encoder.engines.sglang_frames import embedding_frames, error_frames
from kimi_encoder.engines.transport import ZmqPusher
from kimi_encoder.engines.vllm import write_ec_cache
from kimi_encoder.items import plan_image

SIZES = [(100, 37), (64, 64), (300, 20)]  # (width, height), one image each
HIDDEN = 32
ERROR = ("cannot read the image header", 400)


def scenario(dtype: torch.dtype):
    """Images, their K3 grids and sizes, and seeded features with K3's token counts."""
    images = [image_bytes("RGB", size, seed=i) for i, size in enumerate(SIZES)]
    items = [plan_image(data, PreprocessConfig(), "cpu") for data in images]
    tokens = [VisionConfig().num_tokens(item.grid) for item in items]
    features = torch.randn(sum(tokens), HIDDEN, generator=torch.Generator().manual_seed(0))
    return images, items, tokens, features.to(dtype)


def split(n: int, parts: int) -> list[range]:
    """sglang's split of n items over encoders: contiguous, the remainder to the first."""
    base, extra = divmod(n, parts)
    bounds = [0]
    for k in range(parts):
        bounds.append(bounds[-1] + base + (1 if k < extra else 0))
    return [range(a, b) for a, b in itertools.pairwise(bounds)]


def part_payloads(args):
    """One (request, frames) per part, as the encoder would answer each ``/encode``."""
    images, items, tokens, features = scenario(getattr(torch, args.dtype))
    offsets = [0]
    for count in tokens:
        offsets.append(offsets[-1] + count)
    payloads = []
    for k, indices in enumerate(split(len(images), args.num_parts)):
        body = {
            "encoder_idx": k,
            "encoder_url": f"http://encoder-{k}:8000",
            "mm_items": [
                "data:image/png;base64," + base64.b64encode(images[i]).decode() for i in indices
            ],
            "num_parts": args.num_parts,
            "part_idx": k,
            "req_id": f"{args.rid}_local_part_{k}",
            "modality": "IMAGE",
            "prefill_host": args.host,
            "embedding_port": args.port,
            "time_stats_json": None,
        }
        req = EncodeRequest.from_json(body)
        assert [image.data for image in load_images(req, FetchPolicy())] == [
            images[i] for i in indices
        ]
        rows = features[offsets[indices.start] : offsets[indices.stop]]
        grids = torch.cat([items[i].grid_thws for i in indices])
        sizes = [items[i].original_size for i in indices]
        payloads.append((req, embedding_frames(req, rows, grids, sizes), list(indices)))
    spec = {
        "rid": args.rid,
        "dtype": args.dtype,
        "tokens": tokens,
        "grids": [item.grid_thws[0].tolist() for item in items],
        "sizes": [list(item.original_size) for item in items],
        "parts": [{"req_id": req.req_id, "items": idx} for req, _, idx in payloads],
        "error": list(ERROR),
    }
    _write(args.out, spec, features)
    return payloads


async def push(args) -> None:
    pusher, registry = ZmqPusher(send_timeout_s=30), ReceiverRegistry()
    try:
        for req, frames, _ in part_payloads(args):
            for url in args.receive_url:
                registry.register(
                    ReceiveUrlRequest(req.req_id, len(args.receive_url), url, "IMAGE")
                )
            await deliver(req, frames, pusher, registry, wait_s=30)
    finally:
        pusher.close(linger_s=30)  # let the queued frames leave before exiting


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["frames", "push", "ec"])
    parser.add_argument("out", type=Path)
    parser.add_argument("root", type=Path, nargs="?")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--num-parts", type=int, default=1)
    parser.add_argument("--rid", default="interop")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int)
    parser.add_argument("--receive-url", action="append", default=[])
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.mode == "frames":
        for req, frames, _ in part_payloads(args):
            for i, frame in enumerate(frames):
                (args.out / f"{req.part_idx}.frame{i}").write_bytes(bytes(frame))
            (args.out / f"{req.part_idx}.error").write_bytes(bytes(error_frames(req, *ERROR)[0]))
    elif args.mode == "push":
        asyncio.run(push(args))
    else:
        _, _, tokens, features = scenario(getattr(torch, args.dtype))
        offsets = [0]
        for count in tokens:
            offsets.append(offsets[-1] + count)
        entries = [
            write_ec_cache(args.root, f"img-{i}", features[offsets[i] : offsets[i + 1]])
            for i in range(len(tokens))
        ]
        spec = {"tokens": tokens, "uuids": [e.uuid for e in entries], "dtype": args.dtype}
        _write(args.out, spec, features)


def _write(out: Path, spec: dict, features: torch.Tensor) -> None:
    (out / "spec.json").write_text(json.dumps(spec))
    save_file({"features": features.contiguous()}, out / "expected.safetensors")


if __name__ == "__main__":
    main()
