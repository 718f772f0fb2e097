"""The offline CLI: encode writes the documented tensors; bad files exit 2 naming the file."""

import subprocess
import sys
from pathlib import Path

import torch
from images import image_bytes
from safetensors.torch import load_file

from kimi_encoder.cli import main


def test_encode_matches_library(oracle_dir, oracle_encoder, tmp_path):
    images = sorted(str(p) for p in (oracle_dir / "images").iterdir())
    out = tmp_path / "out.safetensors"
    args = [
        "encode",
        "--checkpoint",
        str(oracle_dir / "checkpoint"),
        "--backend",
        "cpu",
        "--device",
        "cpu",
        "--out",
        str(out),
        "--save-pixels",
        *images,
    ]
    assert main(args) == 0
    got = load_file(str(out))
    expected = load_file(str(oracle_dir / "expected.safetensors"))
    for i in range(len(images)):
        assert got[f"grid_thw.{i}"].dtype == torch.int64
        assert torch.equal(got[f"grid_thw.{i}"], expected[f"grid_thw.{i}"])
        torch.testing.assert_close(
            got[f"pixel_values.{i}"], expected[f"pixel_values.{i}"], atol=1e-6, rtol=0
        )
        torch.testing.assert_close(
            got[f"features.{i}"], expected[f"features.{i}"], atol=1e-4, rtol=0
        )


def test_bad_file_names_it(tmp_path, capsys):
    good = tmp_path / "good.png"
    good.write_bytes(image_bytes("RGB", (40, 40)))
    bad = tmp_path / "broken.png"
    bad.write_bytes(image_bytes("RGB", (40, 40))[:60])
    code = main(["encode", "--out", str(tmp_path / "o.safetensors"), str(good), str(bad)])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2
    assert err.startswith(f"kimi-encoder: {bad}:")
    assert "cannot" in err
    assert not Path(tmp_path / "o.safetensors").exists()


def test_missing_file(tmp_path, capsys):
    code = main(["encode", "--out", str(tmp_path / "o.safetensors"), str(tmp_path / "nope.png")])
    assert code == 2
    assert "nope.png" in capsys.readouterr().err


def test_runs_as_a_module():
    """``python -m kimi_encoder`` is the CLI, without the entry point on the PATH."""
    done = subprocess.run(
        [sys.executable, "-m", "kimi_encoder", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: kimi-encoder")
    for command in ("encode", "make-checkpoint", "client"):
        assert command in done.stdout


def test_one_shot_encode_runs_eagerly_by_default():
    """One encode would pay a compile or a capture it never wins back ('auto' is the
    service's default, not the command's)."""
    from kimi_encoder.cli import build_parser

    args = build_parser().parse_args(["encode", "--out", "f.safetensors", "a.png"])
    assert args.execution == "eager"
