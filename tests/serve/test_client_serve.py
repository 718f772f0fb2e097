"""`kimi-encoder client` on the running app: 200 files, one corrupt; a progress bar in tmux."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import requests
from images import image_bytes
from safetensors import safe_open
from serve_helpers import b64, decode_features, encode

KINDS = ("RGB", "RGBA", "P", "JPEG", "L")


@pytest.fixture(scope="module")
def url(deploy) -> str:
    return deploy(2)


def write_images(root: Path, count: int, seed: int = 0) -> list[Path]:
    """``count`` small seeded images of mixed sizes and modes, in two subdirectories."""
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(count):
        width, height = (int(v) for v in rng.integers(16, 96, size=2))
        kind = KINDS[i % len(KINDS)]
        path = root / ("a" if i % 2 else "b") / f"img_{i:03d}.{'jpg' if kind == 'JPEG' else 'png'}"
        path.parent.mkdir(parents=True, exist_ok=True)
        mode, fmt = ("RGB", "JPEG") if kind == "JPEG" else (kind, "PNG")
        path.write_bytes(image_bytes(mode, (width, height), seed * 1000 + i, fmt=fmt))
        paths.append(path)
    return paths


def rank_items(url: str) -> int:
    return sum(r["items"] for r in requests.get(f"{url}/v1/info", timeout=30).json()["ranks"])


def run_client(url: str, out: Path, *inputs: str, **kw) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "kimi_encoder.cli", "client", "--url", url, "--out", str(out)]
    return subprocess.run(
        [*command, "--concurrency", "4", "--batch-size", "8", *inputs],
        capture_output=True,
        text=True,
        timeout=300,
        **kw,
    )


def test_200_files_one_corrupt(url, tmp_path):
    root = tmp_path / "images"
    paths = write_images(root, 195)
    extra = tmp_path / "extra"  # passed as a glob and as a plain file
    extra.mkdir()
    (extra / "x1.png").write_bytes(image_bytes("RGB", (70, 30), 9001))
    (extra / "x2.png").write_bytes(image_bytes("RGBA", (33, 81), 9002))
    (root / "b" / "copy_of_img_010.png").write_bytes(paths[10].read_bytes())  # same bytes
    corrupt = root / "a" / "corrupt.png"
    corrupt.write_bytes(os.urandom(2000))
    single = tmp_path / "single.jpg"
    single.write_bytes(image_bytes("RGB", (58, 44), 9003, fmt="JPEG"))
    inputs = [str(root), str(extra / "*.png"), str(single)]
    good = sorted([*paths, *extra.glob("*.png"), root / "b" / "copy_of_img_010.png", single])
    assert len(good) + 1 == 200

    before = rank_items(url)
    out = tmp_path / "out"
    started = time.monotonic()
    result = run_client(url, out, *inputs)
    seconds = time.monotonic() - started
    print(f"\nclient: 200 files in {seconds:.1f} s\n{result.stderr.strip()}")
    assert result.returncode == 1, result.stderr
    assert "\r" not in result.stderr, "no progress bar when stderr is not a terminal"
    failed = result.stderr.split("failed (1):", 1)[1].strip().splitlines()
    assert len(failed) == 1, failed
    assert failed[0].startswith(f"{corrupt}: item "), failed
    assert "cannot read the image header" in failed[0]
    # Each distinct good image was encoded exactly once: the copy and the corrupt file's
    # batch neighbours were not sent again (the corrupt file never reached a rank).
    assert rank_items(url) - before == len(good) - 1

    outputs = sorted(out.rglob("*.safetensors"))
    assert len(outputs) == 199
    by_source: dict[str, tuple[np.ndarray, np.ndarray, dict]] = {}
    for path in outputs:
        with safe_open(str(path), "np") as f:
            by_source[f.metadata()["source"]] = (
                f.get_tensor("features"),
                f.get_tensor("grid_thw"),
                f.metadata(),
            )
    assert sorted(by_source) == sorted(str(p) for p in good)
    assert out / "a" / f"{paths[1].name}.safetensors" in outputs  # directory layout kept
    copy = by_source[str(root / "b" / "copy_of_img_010.png")]
    np.testing.assert_array_equal(copy[0], by_source[str(paths[10])][0])

    # The HTTP API's features for the same images (its own batches of 10).
    for start in range(0, len(good), 10):
        chunk = good[start : start + 10]
        body = encode(url, [{"type": "image", "image": b64(p.read_bytes())} for p in chunk])
        assert body.status_code == 200, body.text
        for path, item in zip(chunk, body.json()["items"], strict=True):
            features, grid, meta = by_source[str(path)]
            assert grid.tolist() == [item["grid_thw"]]
            assert meta["model"] == "preset:tiny"
            assert meta["owner_rank"] in ("0", "1")
            np.testing.assert_allclose(features, decode_features(item), rtol=0, atol=1e-5)


def test_per_batch_output(url, tmp_path):
    paths = write_images(tmp_path / "images", 11, seed=3)
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "kimi_encoder.cli", "client", "--url", url, "--out", str(out),
         "--batch-size", "4", "--per-batch", str(tmp_path / "images")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    batches = sorted(out.glob("batch-*.safetensors"))
    assert [p.name for p in batches] == [f"batch-{i:05d}.safetensors" for i in range(3)]
    files = []
    for path in batches:
        with safe_open(str(path), "np") as f:
            names = json.loads(f.metadata()["files"])
            owners = json.loads(f.metadata()["owner_ranks"])
            assert len(names) == len(owners) == len(f.keys()) // 2
            files += [n[0] for n in names]
    assert sorted(files) == sorted(str(p) for p in paths)


def test_progress_bar_in_a_terminal(url, tmp_path):
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed (apt-get install tmux)")
    write_images(tmp_path / "images", 30, seed=7)
    done = tmp_path / "exit-code"
    command = " ".join(
        shlex.quote(a)
        for a in [sys.executable, "-m", "kimi_encoder.cli", "client", "--url", url,
                  "--out", str(tmp_path / "out"), "--batch-size", "3", "--concurrency", "2",
                  str(tmp_path / "images")]
    )  # fmt: skip
    socket = f"kimi-encoder-test-{os.getpid()}"
    tmux = ["tmux", "-L", socket]
    subprocess.run(
        [*tmux, "new-session", "-d", "-x", "160", "-y", "12",
         f"cd {shlex.quote(os.getcwd())}; {command}; echo $? > {done}; sleep 120"],
        check=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while not done.exists() or not done.read_text().strip():
            assert time.monotonic() < deadline, "the client did not finish under tmux"
            time.sleep(0.3)
        screen = subprocess.run(
            [*tmux, "capture-pane", "-p", "-J"], check=True, capture_output=True, text=True
        ).stdout
    finally:
        subprocess.run([*tmux, "kill-server"], check=False)
    print(f"\n{screen.strip()}")
    assert done.read_text().strip() == "0", screen
    bar = re.search(
        r"\[#{24}\] 30/30 images \| [\d.]+ img/s \| [\d,]+ patches/s \| ETA 0:00", screen
    )
    assert bar, screen
    assert "encoded 30 of 30 files (30 distinct images" in screen
