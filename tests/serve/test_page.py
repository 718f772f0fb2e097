"""The try-it page at GET /: served by the ingress, self-contained, checked in headless Chromium."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import requests
from serve_helpers import b64, encode

ROOT = Path(__file__).resolve().parents[2]
BROWSER = ROOT / "tests" / "browser"
ARTIFACTS = ROOT / "artifacts"
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")


@pytest.fixture(scope="module")
def url(deploy) -> str:
    return deploy(2)


def test_page_is_served_and_self_contained(url):
    response = requests.get(url, timeout=30)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    page = response.text
    assert "<script>" in page
    assert "<style>" in page
    # Offline: nothing is fetched from another origin (no CDN, no fonts, no src/href URLs).
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)
    assert not re.search(r"""\b(import|fetch)\s*\(\s*["']https?://""", page)
    load = requests.get(f"{url}/v1/load", timeout=30).json()
    assert [r["rank"] for r in load["ranks"]] == [0, 1]
    assert set(load["ranks"][0]) == {
        "rank",
        "inflight_requests",
        "inflight_images",
        "inflight_patches",
        "inflight_bytes",
    }


def browser_missing() -> str | None:
    if shutil.which("node") is None:
        return "node is not installed"
    if not Path(CHROMIUM).exists():
        return f"no Chromium at {CHROMIUM} (apt-get install chromium, or set $CHROMIUM)"
    if not (BROWSER / "node_modules" / "playwright-core").is_dir():
        return "playwright-core is not installed (npm ci --prefix tests/browser)"
    return None


def test_page_in_headless_chromium(url, images, tmp_path):
    if reason := browser_missing():
        pytest.skip(reason)
    image = tmp_path / "big.png"
    image.write_bytes(images[1])  # 700x520: resized, several tokens on each side
    ARTIFACTS.mkdir(exist_ok=True)
    screenshot = ARTIFACTS / "page.png"
    out = subprocess.run(
        ["node", str(BROWSER / "check_page.mjs"), url, str(image), str(screenshot)],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "CHROMIUM": CHROMIUM},
    )
    assert out.returncode == 0, out.stderr[-4000:]
    shown = json.loads(out.stdout.strip().splitlines()[-1])
    assert shown["state"] == "done", shown
    assert shown["consoleErrors"] == [], shown["consoleErrors"]
    assert shown["ranksShown"] == [0, 1]
    assert "preset:tiny" in shown["model"]

    api = encode(url, [{"type": "image", "image": b64(images[1])}]).json()
    item = api["items"][0]
    fields = shown["fields"]
    assert fields["original"] == "700 x 520" == " x ".join(map(str, item["original_size"]))
    assert fields["resized"] == " x ".join(map(str, item["resized_size"]))
    assert fields["grid"] == " x ".join(map(str, item["grid_thw"]))
    assert fields["tokens"] == str(item["num_tokens"])
    assert fields["owner"] == str(item["owner_rank"])
    for stage in (
        "admission",
        "queue_wait",
        "preprocess",
        "forward",
        "transfer",
        "gather",
        "total",
    ):
        assert float(fields[stage]) >= 0, (stage, fields[stage])
    assert fields["request_id"] not in ("", "-")
    # The feature picture: one pixel per token on the merged grid, not a flat colour.
    _, gh, gw = item["grid_thw"]
    canvas = shown["canvas"]
    assert (canvas["width"], canvas["height"]) == (gw // 2, gh // 2)
    assert canvas["width"] * canvas["height"] == item["num_tokens"]
    assert canvas["colors"] > item["num_tokens"] // 2, canvas
    assert canvas["shownWidth"] > 50
    assert canvas["shownHeight"] > 50
    assert np.prod(item["shape"]) > 0
    assert screenshot.stat().st_size > 10_000
    print(f"\nscreenshot: {screenshot}")
