"""Hub checkpoints (``hf://REPO[@REVISION]``) against a hub on loopback.

``benchmarks.loopback_hub`` speaks the hub's HTTP as huggingface_hub uses it (the file
list, ``resolve`` with ``HEAD`` and ranged ``GET``, large files redirected to a second
host:port, ETag and commit headers) and counts what it sends. The checkpoint is the tiny
preset's tower in Kimi-K3's layout: six shards, the vision tensors in two of them between
language-model tensors, the language part 20x the vision part.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from images import image_bytes

from benchmarks.loopback_hub import LoopbackHub, write_k3_layout
from kimi_encoder.encoder import VisionEncoder
from kimi_encoder.hub import (
    RECORD_FILE,
    Hub,
    HubError,
    HubRef,
    cached_path,
    config_dir,
    fetch,
    log_progress,
)
from kimi_encoder.weights import INDEX_FILE, read_vision_tensors, start_allowance_s

REPO = "moonshotai/Kimi-K3"
ROOT = Path(__file__).resolve().parents[2]
MIB = 1 << 20


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("k3-layout")
    return root, write_k3_layout(root, "tiny", seed=3, shards=6, language_ratio=20)


@pytest.fixture
def hub(checkpoint):
    with LoopbackHub() as server:
        server.commit = server.add(REPO, checkpoint[0])
        yield server


def client(server: LoopbackHub, tmp_path: Path, **kw) -> Hub:
    return Hub(
        endpoint=server.endpoint,
        cache_dir=tmp_path / "kimi-encoder",
        hub_cache_dir=tmp_path / "hub",
        **kw,
    )


def left_behind(tmp_path: Path) -> list[str]:
    """Whatever in our cache could pass for a fetched checkpoint, or a half-written one."""
    cache = tmp_path / "kimi-encoder"
    if not cache.exists():
        return []
    return sorted(
        str(p.relative_to(cache))
        for p in cache.rglob("*")
        if p.name.endswith(".safetensors") or ".tmp-" in p.name or p.name == RECORD_FILE
    )


def test_the_checkpoint_is_laid_out_like_k3s(checkpoint):
    root, layout = checkpoint
    assert layout["language_bytes"] >= 20 * layout["vision_bytes"]
    index = json.loads((root / INDEX_FILE).read_text())["weight_map"]
    shards = {s for k, s in index.items() if k.startswith(("vision_tower.", "mm_projector."))}
    assert sorted(shards) == layout["vision_shards"]
    for shard in shards:  # language tensors on both sides of the vision ones
        keys = [k for k, s in index.items() if s == shard]
        first = next(i for i, k in enumerate(keys) if not k.startswith("language_model."))
        last = max(i for i, k in enumerate(keys) if not k.startswith("language_model."))
        assert first > 0, keys
        assert last < len(keys) - 1, keys


def test_a_fetch_reads_only_the_vision_bytes_and_equals_the_local_read(hub, checkpoint, tmp_path):
    root, layout = checkpoint
    fetched = fetch(HubRef.parse(f"hf://{REPO}"), client(hub, tmp_path))
    served = hub.body_bytes(".safetensors")
    touched = {r.path for r in hub.log if r.path.endswith(".safetensors")}
    assert served <= layout["vision_bytes"] + MIB * len(layout["vision_shards"]), served
    assert {Path(p).name for p in touched} == set(layout["vision_shards"])
    assert fetched.bytes_read == served
    assert fetched.vision_bytes == layout["vision_bytes"]
    assert (fetched.shards, fetched.shards_read, fetched.commit) == (6, 2, hub.commit)
    assert fetched.repo_shard_bytes == sum(p.stat().st_size for p in root.glob("model-*"))
    # The large files' bytes came from the storage host the hub redirected to.
    assert {r.host for r in hub.log if r.status == 206} == {"storage"}
    want, got = read_vision_tensors(root), read_vision_tensors(fetched.path)
    assert sorted(want) == sorted(got)
    for key in want:
        assert torch.equal(want[key], got[key]), key

    images = [image_bytes("RGB", (64 + 20 * i, 48 + 10 * i), 500 + i) for i in range(3)]
    local = VisionEncoder.from_pretrained(root, device="cpu", dtype="float32", backend="cpu")
    hubbed = VisionEncoder.from_pretrained(
        fetched.path, device="cpu", dtype="float32", backend="cpu"
    )
    for a, b in zip(
        local.encode([local.plan(x) for x in images]),
        hubbed.encode([hubbed.plan(x) for x in images]),
        strict=True,
    ):
        assert torch.equal(a, b)  # the same weights, shapes and kernels: bit for bit


def test_a_start_that_finds_the_fetch_makes_no_request_for_a_commit(hub, tmp_path):
    client_ = client(hub, tmp_path)
    first = fetch(HubRef.parse(f"hf://{REPO}@main"), client_)
    assert not first.cached
    before = hub.requests()
    again = fetch(HubRef.parse(f"hf://{REPO}@{hub.commit}"), client_)
    assert again.cached
    assert again.path == first.path
    assert hub.requests() == before
    assert config_dir(HubRef.parse(f"hf://{REPO}@{hub.commit}"), client_) == Path(first.path)
    assert hub.requests() == before
    # A branch: one metadata request to learn its commit; none offline.
    assert fetch(HubRef.parse(f"hf://{REPO}@main"), client_).cached
    assert hub.requests() == before + 1
    offline = client(hub, tmp_path, offline=True)
    assert fetch(HubRef.parse(f"hf://{REPO}@main"), offline).cached
    assert hub.requests() == before + 1
    assert cached_path(f"hf://{REPO}@main", offline) == Path(first.path)


def test_concurrent_fetches_on_a_node_fetch_once(hub, checkpoint, tmp_path):
    client_, ref = client(hub, tmp_path), HubRef.parse(f"hf://{REPO}@{hub.commit}")
    results: list = []
    threads = [threading.Thread(target=lambda: results.append(fetch(ref, client_))) for _ in "ab"]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(results) == 2
    assert sorted(r.cached for r in results) == [False, True]
    fetched = next(r for r in results if not r.cached)  # the other read its record
    assert hub.body_bytes(".safetensors") == fetched.bytes_read
    ranged = [r for r in hub.log if r.range and r.status == 206]
    assert len({(r.path, r.range) for r in ranged}) == len(ranged)  # no range read twice


def test_a_cut_connection_resumes_where_it_stopped(hub, checkpoint, tmp_path):
    root, layout = checkpoint
    shard = layout["vision_shards"][0]
    hub.cut_next(shard, 100_000, skip=1)  # the header read passes, the vision range is cut
    fetched = fetch(HubRef.parse(f"hf://{REPO}"), client(hub, tmp_path))
    reads = [r for r in hub.log if r.path == shard and r.status == 206]
    cut, resumed = reads[1], reads[2]
    assert cut.body_bytes == 100_000
    cut_start = int(cut.range.removeprefix("bytes=").split("-")[0])
    assert resumed.range == f"bytes={cut_start + 100_000}-{cut.range.split('-')[1]}"
    assert fetched.bytes_read == hub.body_bytes(".safetensors")
    want, got = read_vision_tensors(root), read_vision_tensors(fetched.path)
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_gated_repository_without_a_token_says_set_hf_token(checkpoint, tmp_path):
    with LoopbackHub() as server:
        server.add(REPO, checkpoint[0], gated_token="hf_secret")
        with pytest.raises(HubError, match=r"gated .*HTTP 401.* set HF_TOKEN"):
            fetch(HubRef.parse(f"hf://{REPO}"), client(server, tmp_path))
        with pytest.raises(HubError, match=r"gated .*HTTP 403.* set HF_TOKEN"):
            fetch(HubRef.parse(f"hf://{REPO}"), client(server, tmp_path, token="hf_wrong"))
        assert left_behind(tmp_path) == []
        fetched = fetch(HubRef.parse(f"hf://{REPO}"), client(server, tmp_path, token="hf_secret"))
        assert fetched.shards_read == 2


@pytest.mark.parametrize(
    ("name", "match"),
    [
        (
            "hf://moonshotai/Nope",
            r"No repository 'moonshotai/Nope' at http://127\.0\.0\.1:\d+ \(HTTP 401, reading "
            r"the repository's file list\): check the name and HF_ENDPOINT; if it is private or "
            r"gated, set HF_TOKEN",
        ),
        (f"hf://{REPO}@no-such-branch", r"has no revision 'no-such-branch' \(HTTP 404\)"),
    ],
    ids=["repository", "revision"],
)
def test_not_found_names_what(hub, tmp_path, name, match):
    with pytest.raises(HubError, match=match):
        fetch(HubRef.parse(name), client(hub, tmp_path))
    assert left_behind(tmp_path) == []


def test_a_header_without_the_vision_keys_its_index_lists(checkpoint, tmp_path):
    root = tmp_path / "bad"
    shutil.copytree(checkpoint[0], root)
    index = json.loads((root / INDEX_FILE).read_text())
    key = next(k for k in index["weight_map"] if k.startswith("vision_tower."))
    index["weight_map"][key] = "model-00001-of-00006.safetensors"  # a language-only shard
    (root / INDEX_FILE).write_text(json.dumps(index))
    refused(root, tmp_path, rf"model-00001-of-00006.safetensors lacks .*{key}")


def test_no_index_and_no_single_file_is_not_a_kimi_checkpoint(checkpoint, tmp_path):
    root = tmp_path / "configs-only"
    root.mkdir()
    for name in ("config.json", "preprocessor_config.json"):
        shutil.copy(checkpoint[0] / name, root / name)
    refused(root, tmp_path, r"neither model.safetensors.index.json nor model")


def refused(root: Path, tmp_path: Path, match: str) -> None:
    """A fetch of ``root`` served as REPO fails with ``match`` and leaves nothing."""
    with LoopbackHub() as server:
        server.add(REPO, root)
        with pytest.raises(HubError, match=match):
            fetch(HubRef.parse(f"hf://{REPO}"), client(server, tmp_path))
    assert left_behind(tmp_path) == []


def test_offline_with_nothing_cached(hub, tmp_path):
    offline = client(hub, tmp_path, offline=True)
    with pytest.raises(HubError, match=r"HF_HUB_OFFLINE is set and no fetch of .* is cached"):
        fetch(HubRef.parse(f"hf://{REPO}"), offline)
    with pytest.raises(HubError, match=r"HF_HUB_OFFLINE is set .* has not been fetched"):
        fetch(HubRef.parse(f"hf://{REPO}@{hub.commit}"), offline)
    assert hub.requests() == 0
    assert left_behind(tmp_path) == []


def fetch_cli(args: list[str], home: Path, endpoint: str, **popen) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "HF_HOME": str(home),
        "HF_ENDPOINT": endpoint,
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "PYTHONPATH": str(ROOT),
    }
    env.pop("HF_HUB_OFFLINE", None)
    return subprocess.run(
        [sys.executable, "-m", "kimi_encoder", "fetch", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        **popen,
    )


def test_the_cli_fetches_into_the_cache_and_says_what_it_read(hub, tmp_path):
    run = fetch_cli([f"hf://{REPO}"], tmp_path / "home", hub.endpoint)
    assert run.returncode == 0, run.stderr
    path = Path(run.stdout.strip())
    assert path == tmp_path / "home" / "kimi-encoder" / f"models--{REPO.replace('/', '--')}" / (
        "snapshots/" + hub.commit
    )
    assert sorted(p.name for p in path.iterdir()) == sorted(
        ["config.json", "preprocessor_config.json", "model.safetensors", RECORD_FILE]
    )
    assert " of 19 MB in 6 shards (2 with vision tensors) in " in run.stderr, run.stderr
    assert f"read {hub.body_bytes('.safetensors') / 1e6:.3g} MB" in run.stderr, run.stderr


def test_a_full_disk_leaves_nothing_half_written(hub, tmp_path):
    """A file-size limit below the vision file (EFBIG, as a full disk's ENOSPC)."""
    limit = 300_000  # above the config files, below the 0.89 MB vision file

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    target = tmp_path / "out" / "k3"
    run = fetch_cli(
        [f"hf://{REPO}", "--to", str(target)],
        tmp_path / "home",
        hub.endpoint,
        preexec_fn=small_files,
    )
    assert run.returncode == 1, run.stderr
    assert "No room to write" in run.stderr
    assert "nothing half-written is left" in run.stderr
    assert sorted(p.name for p in target.parent.iterdir()) == [".k3.lock"], run.stderr


def test_a_killed_fetch_leaves_nothing_that_looks_whole_and_the_next_one_finishes(
    hub, checkpoint, tmp_path
):
    """A fetch killed (SIGKILL) in the middle of a vision range: no snapshot at its final
    name, only a temporary directory; the next fetch removes it and completes."""
    held = hub.hold_next(checkpoint[1]["vision_shards"][0])
    home = tmp_path / "home"
    env = {
        **os.environ,
        "HF_HOME": str(home),
        "HF_ENDPOINT": hub.endpoint,
        "PYTHONPATH": str(ROOT),
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "kimi_encoder", "fetch", f"hf://{REPO}"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert held.wait(60), "the fetch never reached the vision range"
        process.kill()
        process.wait(30)
    finally:
        hub.release.set()
    snapshots = home / "kimi-encoder" / f"models--{REPO.replace('/', '--')}" / "snapshots"
    assert not (snapshots / hub.commit).exists()
    assert [p.name for p in snapshots.iterdir() if ".tmp-" in p.name] != []  # the killed one's
    fetched = fetch(
        HubRef.parse(f"hf://{REPO}"),
        Hub(endpoint=hub.endpoint, cache_dir=home / "kimi-encoder", hub_cache_dir=tmp_path / "hub"),
    )
    assert sorted(p.name for p in snapshots.iterdir()) == [f".{hub.commit}.lock", hub.commit]
    want, got = read_vision_tensors(checkpoint[0]), read_vision_tensors(fetched.path)
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_a_malformed_hub_name():
    with pytest.raises(ValueError, match=r"malformed; write hf://OWNER/NAME or"):
        HubRef.parse("hf://just-a-name")
    with pytest.raises(ValueError, match=r"malformed"):
        HubRef.parse(f"hf://{REPO}@")


def test_the_start_allowance_adds_the_fetch_until_this_node_has_it(hub, tmp_path, monkeypatch):
    name = f"hf://{REPO}@{hub.commit}"
    monkeypatch.setattr(
        "kimi_encoder.hub_files.default_cache_dir", lambda: tmp_path / "kimi-encoder"
    )
    seconds, priced = start_allowance_s(name)
    assert "their fetch from the hub at 50 MB/s" in priced
    fetch(HubRef.parse(name), client(hub, tmp_path))
    cached_s, priced = start_allowance_s(name)
    assert "fetch" not in priced
    assert "1 MB (its vision weights)" in priced
    assert cached_s < seconds


def test_progress_goes_to_the_log(hub, tmp_path, caplog):
    import logging

    logger = logging.getLogger("test_hub_progress")
    with caplog.at_level(logging.INFO, logger="test_hub_progress"):
        fetch(
            HubRef.parse(f"hf://{REPO}"),
            client(hub, tmp_path),
            progress=log_progress("x", logger, every_s=0),
        )
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "fetching x: 0.89 MB of vision tensors", lines
    assert lines[-1].startswith("fetching x: 0.89 MB of 0.89 MB (100%)"), lines
