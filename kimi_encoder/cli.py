"""``kimi-encoder`` command line: encode images offline, write seeded checkpoints."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from .config import PRESETS, get_preset
from .encoder import VisionEncoder
from .execution import EXECUTION_MODES
from .features import AUTO_RULE, FEATURE_DTYPES, PIXEL_DTYPE
from .weights import write_checkpoint


def _encode(args: argparse.Namespace) -> int:
    encoder = VisionEncoder.from_pretrained(
        args.checkpoint,
        device=args.device,
        dtype=args.dtype,
        backend=args.backend,
        execution=args.execution,
    )
    items, pixels = [], []
    for path in args.images:
        try:
            item = encoder.plan(Path(path).read_bytes())
            pixels += encoder.materialize([item])
        except (OSError, ValueError) as exc:
            print(f"kimi-encoder: {path}: {exc}", file=sys.stderr)
            return 2
        items.append(item)
    features = encoder.forward(pixels, items)
    tensors: dict[str, torch.Tensor] = {}
    for i, (path, item) in enumerate(zip(args.images, items, strict=True)):
        tensors[f"features.{i}"] = features[i].float().cpu().contiguous()
        tensors[f"grid_thw.{i}"] = item.grid_thws.clone()
        if args.save_pixels:
            tensors[f"pixel_values.{i}"] = pixels[i].cpu().contiguous()
        print(f"{path}: grid {list(item.grid)}, {features[i].shape[0]} tokens", file=sys.stderr)
    meta = {"model": encoder.name, "images": json.dumps([str(p) for p in args.images])}
    save_file(tensors, args.out, metadata=meta)
    print(f"wrote {len(args.images)} image(s) to {args.out}", file=sys.stderr)
    return 0


def _make_checkpoint(args: argparse.Namespace) -> int:
    preset = get_preset(args.preset)
    out = write_checkpoint(args.out_dir, preset.vision, preset.preprocess, seed=args.seed)
    print(f"wrote {args.preset} checkpoint (seed {args.seed}) to {out}", file=sys.stderr)
    return 0


def _fetch(args: argparse.Namespace) -> int:
    from .hub import HubError, HubRef, bar_progress, fetch

    ref = HubRef.parse(args.checkpoint)
    try:
        fetched = fetch(ref, to=args.to, progress=bar_progress(str(ref)))
    except HubError as exc:
        print(f"kimi-encoder: {exc}", file=sys.stderr)
        return 1
    print(fetched.summary(), file=sys.stderr)
    print(fetched.path)
    return 0


def _client(args: argparse.Namespace) -> int:
    from .client_files import run_client  # no torch or model code: only HTTP

    out = Path(args.out)
    report = run_client(
        args.url,
        args.inputs,
        out,
        batch_size=args.batch_size,
        concurrency=args.concurrency,
        per_batch=args.per_batch,
        backend=args.backend,
        feature_dtype=args.feature_dtype,
        api_key=args.api_key,
    )
    rate = report.encoded / report.seconds if report.seconds else 0.0
    print(
        f"encoded {report.files - len(report.failed)} of {report.files} files "
        f"({report.encoded} distinct images, {report.patches} patches) in {report.seconds:.1f} s "
        f"({rate:.1f} img/s); {report.requests} requests, {report.retries} retries; "
        f"wrote {len(report.written)} files to {out}",
        file=sys.stderr,
    )
    if report.failed:
        print(f"failed ({len(report.failed)}):", file=sys.stderr)
        for path, reason in sorted(report.failed.items()):
            print(f"  {path}: {reason}", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kimi-encoder", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    enc = sub.add_parser("encode", help="encode images to a .safetensors file")
    enc.add_argument(
        "--checkpoint",
        default="tiny",
        help=f"checkpoint directory, hf://REPO[@REVISION] or preset ({', '.join(PRESETS)})",
    )
    enc.add_argument("--backend", default="auto", help="preprocessing backend: cpu, gpu or auto")
    enc.add_argument("--device", default="auto", help="torch device: auto, cpu, cuda, cuda:1 ...")
    enc.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", *FEATURE_DTYPES],
        help=f"weights and compute; auto: {AUTO_RULE}",
    )
    # One encode pays no compile or capture it would not win back; a service's ranks do.
    enc.add_argument(
        "--execution",
        default="eager",
        choices=EXECUTION_MODES,
        help="how the tower runs: eager (default), compiled (torch.compile), graphs (CUDA "
        "graphs) or auto (eager on CPU, the fastest measured at start on CUDA)",
    )
    enc.add_argument("--out", required=True, help="output .safetensors file")
    enc.add_argument(
        "--save-pixels",
        action="store_true",
        help=f"also write pixel_values.{{i}} ({PIXEL_DTYPE} [patches, 3, 14, 14])",
    )
    enc.add_argument("images", nargs="+", help="image files; i is the position on this line")
    enc.set_defaults(func=_encode)

    cl = sub.add_parser(
        "client",
        help="send images to a running encode server, write one .safetensors per image",
        description="Encode files, directories (recursively, image suffixes) and globs with "
        "a running server: batches with bounded concurrency, retries with backoff, each "
        "distinct image sent once. Exit code 1 if any file failed (named at the end).",
    )
    cl.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    cl.add_argument("--out", required=True, help="output directory")
    cl.add_argument("--concurrency", type=int, default=4, help="requests in flight (default 4)")
    cl.add_argument("--batch-size", type=int, default=8, help="images per request (default 8)")
    cl.add_argument(
        "--per-batch",
        action="store_true",
        help="write one batch-NNNNN.safetensors per request instead of one file per image",
    )
    cl.add_argument("--backend", choices=["cpu", "gpu"], help="preprocessing backend")
    cl.add_argument(
        "--feature-dtype",
        choices=FEATURE_DTYPES,
        help="dtype of the features asked for and written (default: the server's)",
    )
    cl.add_argument(
        "--api-key",
        default=os.environ.get("KIMI_ENCODER_API_KEY"),
        help="sent as 'Authorization: Bearer KEY' (default: $KIMI_ENCODER_API_KEY)",
    )
    cl.add_argument("inputs", nargs="+", metavar="INPUT", help="image files, directories, globs")
    cl.set_defaults(func=_client)

    fe = sub.add_parser(
        "fetch",
        help="fetch a hub checkpoint's vision weights ahead of time (hf://REPO[@REVISION])",
        description="Read only the vision tower's and projector's bytes of a Kimi checkpoint "
        "on the Hugging Face hub (each shard's header, then those tensors' byte ranges) into "
        "a small local checkpoint: the cache under $HF_HOME/kimi-encoder that the service "
        "reads, or --to DIR. Honours HF_ENDPOINT, HF_TOKEN, HF_HOME and HF_HUB_OFFLINE. "
        "Prints the directory on stdout.",
    )
    fe.add_argument("checkpoint", help="hf://OWNER/NAME[@REVISION], e.g. hf://moonshotai/Kimi-K3")
    fe.add_argument("--to", help="write the checkpoint to this directory instead of the cache")
    fe.set_defaults(func=_fetch)

    ck = sub.add_parser("make-checkpoint", help="write a seeded random original-format checkpoint")
    ck.add_argument("--preset", required=True, help=f"one of {', '.join(PRESETS)}")
    ck.add_argument("--seed", type=int, default=0)
    ck.add_argument("out_dir")
    ck.set_defaults(func=_make_checkpoint)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"kimi-encoder: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
