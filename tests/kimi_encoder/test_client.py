"""``kimi_encoder.client`` without a cluster: retries, Retry-After, isolation, inputs, progress.

A stdlib HTTP server on loopback plays a server under load (scripted statuses);
the client's encode against the real app is in tests/serve/test_client_serve.py.
"""

from __future__ import annotations

import io
import json
import threading
from collections.abc import Iterator
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save

from kimi_encoder.client import EncodeError, EncoderClient, _retry_after
from kimi_encoder.client_files import Progress, RunReport, encode_files, expand_inputs, plan_sources


class Scripted(BaseHTTPRequestHandler):
    """Answers POST /v1/encode from ``server.script``: (status, headers, error) or 'ok'."""

    def do_POST(self) -> None:  # http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        images = [item["image"] for item in body["items"]]
        self.server.seen.append(images)
        step = self.server.script.pop(0) if self.server.script else "ok"
        if callable(step):
            step = step(images)
        if step == "ok":
            tensors = {}
            for i, _ in enumerate(images):
                tensors[f"features.{i}"] = np.full((1, 4), len(images), np.float32)
                tensors[f"grid_thw.{i}"] = np.array([[1, 2, 2]], np.int64)
            blob = save(
                tensors, metadata={"model": "fake", "owner_ranks": json.dumps([0] * len(images))}
            )
            self.send_response(200)
            self.send_header("Content-Length", str(len(blob)))
            self.end_headers()
            self.wfile.write(blob)
            return
        status, headers, message = step
        data = json.dumps({"error": {"type": "x", "message": message}}).encode()
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def server() -> Iterator[ThreadingHTTPServer]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Scripted)
    httpd.script, httpd.seen = [], []
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()


def client_for(server, sleeps: list[float], **kw) -> EncoderClient:
    url = f"http://127.0.0.1:{server.server_address[1]}"
    return EncoderClient(url, sleep=sleeps.append, backoff_s=0.25, **kw)


def test_retries_honour_retry_after(server):
    server.script = [(503, {"Retry-After": "2"}, "busy"), (429, {}, "slow down"), (408, {}, "t")]
    sleeps: list[float] = []
    [out] = client_for(server, sleeps).encode([b"a"])
    assert out.grid_thw == (1, 2, 2)
    assert out.owner_rank == 0
    assert len(server.seen) == 4
    assert sleeps[0] == 2.0  # the server's word
    assert 0.25 <= sleeps[1] <= 0.5
    assert 0.5 <= sleeps[2] <= 1.0


def test_gives_up_after_max_retries_and_never_retries_a_400(server):
    server.script = [(503, {}, "busy")] * 3
    with pytest.raises(EncodeError, match="503 x: busy"):
        client_for(server, [], max_retries=2).encode([b"a"])
    server.script = [(400, {}, "item 0: bad")]
    with pytest.raises(EncodeError) as info:
        client_for(server, [], max_retries=5).encode([b"a"])
    assert info.value.status == 400
    assert info.value.item == 0
    assert len(server.seen) == 4


def test_retry_after_forms():
    assert _retry_after("3") == 3.0
    assert _retry_after(None) is None
    assert 8 <= _retry_after(formatdate(__import__("time").time() + 10, usegmt=True)) <= 10
    assert _retry_after("soon") is None


def test_named_item_fails_alone_and_unnamed_400_bisects(server, tmp_path):
    files = []
    for name in "abcde":
        path = tmp_path / f"{name}.png"
        path.write_bytes(name.encode())
        files.append((path, Path(path.name)))
    bad = "Yw=="  # base64 of b"c"

    def reject_c(images):
        return (400, {}, f"item {images.index(bad)}: cannot read") if bad in images else "ok"

    server.script = [reject_c] * 10
    report = RunReport()
    sources = plan_sources(files, tmp_path / "out", report)
    encode_files(client_for(server, []), sources, batch_size=5, out_dir=tmp_path / "out",
                 report=report)  # fmt: skip
    assert list(report.failed) == [str(tmp_path / "c.png")]
    assert report.encoded == 4
    assert len(server.seen) == 2
    assert len(server.seen[1]) == 4
    assert bad not in server.seen[1]

    server.seen.clear()
    server.script = [lambda imgs: (413, {}, "too many patches") if len(imgs) > 2 else "ok"] * 10
    report = RunReport()
    encode_files(client_for(server, []), sources, batch_size=5, out_dir=tmp_path / "o2",
                 report=report)  # fmt: skip
    assert report.failed == {}
    assert report.encoded == 5
    assert sorted(len(s) for s in server.seen) == [1, 2, 2, 3, 5]  # 5 -> 3 + 2, 3 -> 2 + 1


def test_duplicates_are_sent_once(server, tmp_path):
    (tmp_path / "d").mkdir()
    for name in ("a.png", "b.png", "d/c.png"):
        (tmp_path / name).write_bytes(b"same")
    (tmp_path / "note.txt").write_bytes(b"same")  # not an image suffix: skipped in a dir
    files, missing = expand_inputs([str(tmp_path), str(tmp_path / "nope.png"), "/no/*.png"])
    assert [name.as_posix() for _, name in files] == ["a.png", "b.png", "d/c.png"]
    assert set(missing) == {str(tmp_path / "nope.png"), "/no/*.png"}
    report = RunReport()
    sources = plan_sources(files, tmp_path / "out", report)
    assert report.unique == 1
    assert len(sources) == 1
    encode_files(client_for(server, []), sources, out_dir=tmp_path / "out", report=report)
    assert len(server.seen) == 1
    assert len(server.seen[0]) == 1
    assert sorted(p.relative_to(tmp_path / "out").as_posix() for p in report.written) == [
        "a.png.safetensors", "b.png.safetensors", "d/c.png.safetensors"
    ]  # fmt: skip


def test_progress_line():
    stream = io.StringIO()
    progress = Progress(10, stream, enabled=True, min_interval_s=0)
    progress.started -= 2.0
    progress.update(4, 400)
    line = progress.line(progress.started + 2.0)
    assert line == "[#########...............] 4/10 images | 2.0 img/s | 200 patches/s | ETA 0:03"
    assert stream.getvalue().startswith("\r\x1b[2K[#########")
    silent = io.StringIO()
    Progress(3, silent, enabled=False).update(3, 10)
    assert silent.getvalue() == ""
