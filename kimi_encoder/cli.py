"""``kimi-encoder`` command line: encode images offline, write seeded checkpoints."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from .config import PRESETS, get_preset
from .encoder import DTYPES, VisionEncoder
from .weights import write_checkpoint


def _encode(args: argparse.Namespace) -> int:
    encoder = VisionEncoder.from_pretrained(
        args.checkpoint, device=args.device, dtype=args.dtype, backend=args.backend
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kimi-encoder", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    enc = sub.add_parser("encode", help="encode images to a .safetensors file")
    enc.add_argument(
        "--checkpoint",
        default="tiny",
        help=f"checkpoint directory or preset ({', '.join(PRESETS)})",
    )
    enc.add_argument("--backend", default="auto", help="preprocessing backend: cpu, gpu or auto")
    enc.add_argument("--device", default="auto", help="torch device: auto, cpu, cuda, cuda:1 ...")
    enc.add_argument("--dtype", default="float32", choices=list(DTYPES))
    enc.add_argument("--out", required=True, help="output .safetensors file")
    enc.add_argument(
        "--save-pixels",
        action="store_true",
        help="also write pixel_values.{i} (float32 [patches, 3, 14, 14])",
    )
    enc.add_argument("images", nargs="+", help="image files; i is the position on this line")
    enc.set_defaults(func=_encode)

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
