"""The README runs: its set-up commands, its curl example and every shell and Python
snippet, as a user would type them, against `make serve`.

Snippets are taken from README.md's fenced blocks, not copied here. Only what a
user must change on their machine is substituted (``SUBSTITUTIONS``: the port,
placeholder checkpoint paths, ``cuda`` on a CPU machine); each substituted text
must still be in the README, so an edit there that breaks a snippet fails here.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import requests
import yaml
from images import image_bytes
from safetensors.numpy import load_file
from serve_helpers import free_port, healthy, interrupt, launch

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```(\w+)\n(.*?)```", README, flags=re.S)
STARTUP_TIMEOUT_S = 180


def block(lang: str, first_line_contains: str) -> str:
    """The README's ``lang`` block whose first line contains the text (exactly one)."""
    found = [text for kind, text in BLOCKS if kind == lang and first_line_contains in text]
    assert len(found) == 1, f"{len(found)} {lang} blocks start with {first_line_contains!r}"
    return found[0]


def substitute(text: str, replacements: dict[str, str]) -> str:
    for old, new in replacements.items():
        assert old in text, f"the README snippet no longer contains {old!r}:\n{text}"
        text = text.replace(old, new)
    return text


def run(command: str, cwd: Path, timeout: float = 180) -> str:
    done = subprocess.run(
        ["bash", "-eu", "-c", command],  # as a user types it: no pipefail
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, f"{command}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_set_up_commands_are_the_makefile_and_ci_ones():
    setup = block("bash", "make serve")
    assert [line.split("#")[0].strip() for line in setup.splitlines()] == [
        "make serve",
        "make test",
    ]
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^serve: ", makefile, re.M)
    assert re.search(r"^test: ", makefile, re.M)
    assert "make test" in (ROOT / ".ci" / "run").read_text()


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    """`make serve` with the shipped config moved to a free port; Ctrl-C at the end."""
    port = free_port()
    config = yaml.safe_load((ROOT / "configs" / "config.yaml").read_text())
    config["http_options"]["port"] = port
    tmp = tmp_path_factory.mktemp("readme")
    config_path = tmp / "config.yaml"
    config_path.write_text(yaml.safe_dump(config))
    log = tmp / "serve.log"
    process = launch(["make", "serve", f"CONFIG={config_path}"], log)
    url = f"http://127.0.0.1:{port}"
    ready_s = healthy(url, process, log, STARTUP_TIMEOUT_S)
    print(f"\nmake serve: ready in {ready_s:.1f} s")
    yield {"url": url, "port": port}
    interrupt(process)  # make and serve run; make reports the interrupt with a non-zero code
    assert "Got KeyboardInterrupt, shutting down" in log.read_text(), log.read_text()[-4000:]
    with pytest.raises(requests.ConnectionError):
        requests.get(f"{url}/healthz", timeout=2)


def expected_json() -> dict:
    """The README's example answer, its elided parts dropped."""
    text = next(text for kind, text in BLOCKS if kind == "json")  # the quick start's
    text = re.sub(r",?\s*\.\.\.\n", "\n", text).replace('"…base64 little-endian float32…"', '""')
    return json.loads(text)


def test_quickstart_curl(service):
    curl = substitute(block("bash", "curl -s -F image=@"), {"8000": str(service["port"])})
    shown = run(curl, ROOT)
    assert shown.startswith("{")
    assert '"model": "preset:tiny"' in shown
    want = expected_json()
    full = run(curl.split("|")[0], ROOT)  # the same request, the whole answer
    got = json.loads(full)
    assert got["model"] == want["model"]
    assert got["usage"] == want["usage"]
    (item,) = got["items"]
    for key, value in want["items"][0].items():
        if key not in ("data", "owner_rank"):
            assert item[key] == value, key
    # The owner is the rank that answered: the README shows the usual one, but a rank that
    # does not take the call in time (still starting, a starved machine) hands the image
    # to another, and the answer is just as right.
    config = yaml.safe_load((ROOT / "configs" / "config.yaml").read_text())
    ranks = range(config["applications"][0]["args"]["dp_size"])
    assert want["items"][0]["owner_rank"] in ranks
    assert item["owner_rank"] in ranks


def test_offline_cli(tmp_path):
    make_checkpoint = block("bash", "kimi-encoder encode").strip().splitlines()[-1]
    checkpoint = tmp_path / "tiny-k3"
    venv = str(Path(sys.executable).parent.parent)
    run(substitute(make_checkpoint, {"/tmp/tiny-k3": str(checkpoint), ".venv": venv}), tmp_path)
    (tmp_path / "a.png").write_bytes(image_bytes("RGBA", (120, 80), 1))
    (tmp_path / "b.jpg").write_bytes(image_bytes("RGB", (64, 96), 2, fmt="JPEG"))
    lines = block("bash", "kimi-encoder encode").strip().splitlines()[:-1]
    encode = substitute("\n".join(lines), {"/path/to/Kimi-K3": str(checkpoint), ".venv": venv})
    run(encode, tmp_path)
    out = load_file(str(tmp_path / "features.safetensors"))
    assert out["features.0"].shape[1] == 80
    assert out["grid_thw.1"].tolist()[0][0] == 1


def test_library_snippet(tmp_path, tiny_checkpoint):
    code = substitute(
        block("python", "from kimi_encoder.encoder import VisionEncoder"),
        {"/path/to/Kimi-K3": str(tiny_checkpoint), 'device="cuda"': 'device="cpu"'},
    )
    (tmp_path / "a.png").write_bytes(image_bytes("P", (70, 50), 3))
    (tmp_path / "b.jpg").write_bytes(image_bytes("RGB", (30, 90), 4, fmt="JPEG"))
    scope: dict = {}
    cwd = Path.cwd()
    os.chdir(tmp_path)
    try:
        exec(compile(code, "README.md", "exec"), scope)  # the README's own code
    finally:
        os.chdir(cwd)
    features = scope["features"]
    assert len(features) == 2
    assert all(f.shape[1] == 80 for f in features)


def test_client_snippets(service, tmp_path):
    port = {"8000": str(service["port"])}
    (tmp_path / "photos" / "trip").mkdir(parents=True)
    (tmp_path / "photos" / "trip" / "x.png").write_bytes(image_bytes("RGB", (60, 40), 5))
    (tmp_path / "photos" / "y.webp").write_bytes(image_bytes("RGB", (44, 30), 6, fmt="WEBP"))
    (tmp_path / "more").mkdir()
    (tmp_path / "more" / "z.jpg").write_bytes(image_bytes("RGB", (50, 50), 7, fmt="JPEG"))
    (tmp_path / "one.png").write_bytes(image_bytes("L", (32, 32), 8))
    venv = str(Path(sys.executable).parent.parent)
    cli = substitute(block("bash", "kimi-encoder client"), {**port, ".venv": venv})
    run(cli, tmp_path)
    written = {str(p.relative_to(tmp_path / "features")) for p in tmp_path.rglob("*.safetensors")}
    want = {"trip/x.png", "y.webp", "z.jpg", "one.png"}  # laid out like each input
    assert written == {f"{name}.safetensors" for name in want}, written
    (tmp_path / "cat.png").write_bytes(image_bytes("RGBA", (48, 36), 9))
    code = substitute(block("python", "from kimi_encoder.client import EncoderClient"), port)
    scope: dict = {}
    cwd = Path.cwd()
    os.chdir(tmp_path)
    try:
        exec(compile(code, "README.md", "exec"), scope)  # the README's own code
    finally:
        os.chdir(cwd)
    assert scope["out"].features.shape[1] == 80
    assert scope["out"].grid_thw[0] == 1
    shutil.rmtree(tmp_path / "features")
