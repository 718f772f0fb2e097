"""A hub on loopback: the part of the Hugging Face hub's HTTP that huggingface_hub uses to
read a model repository, serving checkpoints this project writes in Kimi-K3's layout.

For the hub tests and ``bench_hub``: point ``HF_ENDPOINT`` at ``LoopbackHub.endpoint``.
Two servers, as on the hub: the hub itself (``/api/models/REPO/revision/REV`` with the
file list and sizes; ``HEAD``/``GET /REPO/resolve/REV/FILE`` with the commit, ETag and
size headers) and a storage host that the hub redirects large files' bytes to, which
answers ``Range`` requests with ``206`` and ``Content-Range``. Both count every request and
every body byte they send. A repository may be gated (a token required), and a test may
have the next ranged read of a file cut after some bytes.

``write_k3_layout`` writes a checkpoint as Kimi-K3's repository lays it out: several
``model-0000K-of-0000N.safetensors`` shards under ``model.safetensors.index.json``, the
vision tensors spread over two of them between language-model tensors, the language part
many times the vision part.
"""

from __future__ import annotations

import hashlib
import json
import socket
import struct
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlparse

import torch

from kimi_encoder.config import get_preset
from kimi_encoder.weights import INDEX_FILE, random_state_dict, write_checkpoint

# Files stored as large objects (LFS or Xet on the hub): their bytes come from storage.
LARGE_SUFFIXES = (".safetensors",)
DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


# --- a checkpoint in K3's layout ------------------------------------------------------


def write_k3_layout(
    out: str | Path,
    preset: str = "tiny",
    *,
    seed: int = 0,
    shards: int = 6,
    language_ratio: float = 20.0,
    dtype: torch.dtype = torch.float32,
) -> dict:
    """A checkpoint of ``preset``'s vision tower (seeded random weights) in K3's sharded
    layout, its language part ``language_ratio`` x the vision bytes (seeded noise). The
    vision tensors lie in the two middle shards, each between language tensors. Returns
    {vision_bytes, language_bytes, shards, vision_shards}."""
    out = Path(out)
    spec = get_preset(preset)
    write_checkpoint(out, spec.vision, spec.preprocess, seed=seed)  # the config files
    (out / "model.safetensors").unlink()
    vision = {k: v.to(dtype).contiguous() for k, v in random_state_dict(spec.vision, seed).items()}
    vision_bytes = sum(t.numel() * t.element_size() for t in vision.values())
    # Language tensors of 256 kB .. 4 MB each, so shards hold several.
    per_tensor = max(256 << 10, min(4 << 20, int(vision_bytes * language_ratio) // (8 * shards)))
    gen = torch.Generator().manual_seed(seed + 1)
    language_total = int(vision_bytes * language_ratio)
    count = -(-language_total // per_tensor)
    language = [
        (
            f"language_model.model.layers.{i}.mlp.experts.weight",
            torch.randn(per_tensor // dtype.itemsize // 64, 64, generator=gen).to(dtype),
        )
        for i in range(count)
    ]
    keys = sorted(vision)
    middle = [shards // 2 - 1, shards // 2]
    halves = {middle[0]: keys[: len(keys) // 2], middle[1]: keys[len(keys) // 2 :]}
    lang_per_shard = -(-count // shards)
    weight_map: dict[str, str] = {}
    for k in range(shards):
        name = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        mine = language[k * lang_per_shard : (k + 1) * lang_per_shard]
        vis = [(key, vision[key]) for key in halves.get(k, [])]
        half = len(mine) // 2
        ordered = mine[:half] + vis + mine[half:]  # vision between language tensors
        write_ordered_safetensors(out / name, ordered)
        weight_map.update({key: name for key, _ in ordered})
    index = {
        "metadata": {"total_size": vision_bytes + count * per_tensor},
        "weight_map": weight_map,
    }
    (out / INDEX_FILE).write_text(json.dumps(index, indent=1) + "\n")
    return {
        "vision_bytes": vision_bytes,
        "language_bytes": sum(t.numel() * t.element_size() for _, t in language),
        "shards": shards,
        "vision_shards": [f"model-{k + 1:05d}-of-{shards:05d}.safetensors" for k in middle],
    }


def write_ordered_safetensors(path: Path, tensors: list[tuple[str, torch.Tensor]]) -> None:
    """A safetensors file with its tensors' bytes in the order given (``save_file`` sorts
    them), so a test can place vision tensors between language ones."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for key, tensor in tensors:
        size = tensor.numel() * tensor.element_size()
        header[key] = {
            "dtype": DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for _, tensor in tensors:
            f.write(tensor.contiguous().view(torch.uint8).numpy().tobytes())


# --- the servers ----------------------------------------------------------------------


@dataclass
class Repo:
    root: Path  # the checkpoint directory served
    commit: str
    branches: dict[str, str] = field(default_factory=dict)
    gated_token: str | None = None  # the token a gated repository asks for

    def files(self) -> dict[str, Path]:
        return {p.name: p for p in sorted(self.root.iterdir()) if p.is_file()}


@dataclass
class Served:
    """What the servers sent: one row per request."""

    host: str  # "hub" or "storage"
    method: str
    path: str
    range: str | None
    status: int
    body_bytes: int


class LoopbackHub:
    """Two HTTP servers on 127.0.0.1 (hub and storage), as a context manager."""

    def __init__(self):
        self.repos: dict[str, Repo] = {}
        self.log: list[Served] = []
        self.cuts: dict[str, list[int]] = {}  # file name -> [ranged reads to let by, bytes]
        self.holds: dict[str, threading.Event] = {}  # file name -> set once a read waits
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.hub = _server(self, "hub")
        self.storage = _server(self, "storage")
        self.blobs: dict[str, Path] = {}

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.hub.server_address[1]}"

    @property
    def storage_url(self) -> str:
        return f"http://127.0.0.1:{self.storage.server_address[1]}"

    def add(self, repo_id: str, root: str | Path, *, branch: str = "main", gated_token=None) -> str:
        """Serve ``root`` as ``repo_id`` at a commit derived from its files; its commit."""
        root = Path(root)
        digest = hashlib.sha1(repo_id.encode())
        for name, path in Repo(root, "").files().items():
            digest.update(name.encode() + str(path.stat().st_size).encode())
        commit = digest.hexdigest()
        self.repos[repo_id] = Repo(root, commit, {branch: commit}, gated_token)
        for path in root.iterdir():
            if path.name.endswith(LARGE_SUFFIXES):
                self.blobs[_sha256_of_name(repo_id, path)] = path
        return commit

    def cut_next(self, filename: str, after_bytes: int, skip: int = 0) -> None:
        """The ranged read of ``filename`` after the next ``skip`` ones sends ``after_bytes``
        and drops the connection (its Content-Length promising the whole range)."""
        self.cuts[filename] = [skip, after_bytes]

    def hold_next(self, filename: str) -> threading.Event:
        """The next ranged read of ``filename`` after its first (the header's) waits, having
        sent half its bytes, until ``release`` is set; the event returned is set once one
        waits."""
        self.release.clear()
        self.holds[filename] = threading.Event()
        self.holds[filename].skip = 1
        return self.holds[filename]

    def requests(self) -> int:
        return len(self.log)

    def body_bytes(self, suffix: str = "") -> int:
        """Body bytes sent for paths ending in ``suffix`` (storage answers by blob, so
        large files' bytes count under the file they were redirected from)."""
        return sum(r.body_bytes for r in self.log if r.path.endswith(suffix))

    def __enter__(self) -> LoopbackHub:
        for server in (self.hub, self.storage):
            threading.Thread(target=server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        for server in (self.hub, self.storage):
            server.shutdown()
            server.server_close()


def _sha256_of_name(repo_id: str, path: Path) -> str:
    # Stands in for the LFS object id: unique per file, cheap (files are not hashed).
    return hashlib.sha256(f"{repo_id}/{path.name}/{path.stat().st_size}".encode()).hexdigest()


def _server(hub: LoopbackHub, role: str) -> ThreadingHTTPServer:
    handler = type(f"{role.title()}Handler", (_Handler,), {"hub": hub, "role": role})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    return server


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the hub
    hub: LoopbackHub
    role: str

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_HEAD(self) -> None:
        self._answer(head=True)

    def do_GET(self) -> None:
        self._answer(head=False)

    # -- routing --

    def _answer(self, head: bool) -> None:
        url = urlparse(self.path)
        path = unquote(url.path)
        self._logged_path = path
        if self.role == "storage":
            return self._blob(path, head)
        if path.startswith("/api/models/") and "/tree/" in path:
            return self._tree(path[len("/api/models/") :])
        if path.startswith("/api/models/"):
            return self._model_info(path[len("/api/models/") :], parse_qs(url.query))
        parts = path.lstrip("/").split("/")
        if len(parts) >= 5 and parts[2] == "resolve":
            repo_id, revision, filename = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
            return self._resolve(repo_id, revision, filename, head)
        self._error(404, "EntryNotFound", "no such route")

    def _repo(self, repo_id: str) -> Repo | None:
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            self._error(401, "RepoNotFound", "Repository not found")
            return None
        if repo.gated_token is not None:
            auth = self.headers.get("Authorization", "")
            if auth != f"Bearer {repo.gated_token}":
                status = 403 if auth else 401
                self._error(status, "GatedRepo", "Access to this model is restricted")
                return None
        return repo

    def _commit(self, repo: Repo, revision: str) -> str | None:
        commit = repo.branches.get(revision, revision if revision == repo.commit else None)
        if commit is None:
            self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return commit

    def _model_info(self, rest: str, query: dict) -> None:
        repo_id, _, revision = rest.partition("/revision/")
        repo = self._repo(repo_id)
        if repo is None:
            return
        commit = self._commit(repo, revision or "main")
        if commit is None:
            return
        siblings = []
        for name, path in repo.files().items():
            row: dict = {"rfilename": name}
            if query.get("blobs"):
                row["size"] = path.stat().st_size
                if name.endswith(LARGE_SUFFIXES):
                    row["lfs"] = {
                        "size": path.stat().st_size,
                        "sha256": _sha256_of_name(repo_id, path),
                        "pointerSize": 134,
                    }
            siblings.append(row)
        body = json.dumps({"id": repo_id, "modelId": repo_id, "sha": commit, "siblings": siblings})
        self._send(200, body.encode(), {"Content-Type": "application/json"})

    def _tree(self, rest: str) -> None:
        """The file list ``snapshot_download`` reads (one page: no ``Link`` header)."""
        repo_id, _, revision = rest.partition("/tree/")
        repo = self._repo(repo_id)
        if repo is None or self._commit(repo, revision.rstrip("/") or "main") is None:
            return
        entries = []
        for name, path in repo.files().items():
            size = path.stat().st_size
            entry = {
                "type": "file",
                "oid": hashlib.sha1(name.encode()).hexdigest(),
                "size": size,
                "path": name,
            }
            if name.endswith(LARGE_SUFFIXES):
                oid = _sha256_of_name(repo_id, path)
                entry["lfs"] = {"oid": oid, "size": size, "pointerSize": 134}
            entries.append(entry)
        self._send(200, json.dumps(entries).encode(), {"Content-Type": "application/json"})

    def _resolve(self, repo_id: str, revision: str, filename: str, head: bool) -> None:
        repo = self._repo(repo_id)
        if repo is None:
            return
        commit = self._commit(repo, revision)
        if commit is None:
            return
        path = repo.files().get(filename)
        if path is None:
            self._error(404, "EntryNotFound", f"{filename} does not exist at {revision}")
            return
        headers = {"X-Repo-Commit": commit}
        if filename.endswith(LARGE_SUFFIXES):  # bytes from storage, as the hub's CDN
            oid = _sha256_of_name(repo_id, path)
            headers.update(
                {
                    "Location": f"{self.hub.storage_url}/blobs/{oid}",
                    "X-Linked-Etag": f'"{oid}"',
                    "X-Linked-Size": str(path.stat().st_size),
                    "ETag": f'"{oid[:40]}"',
                }
            )
            self._send(302, b"", headers, head=head)
            return
        data = path.read_bytes()
        headers["ETag"] = f'"{hashlib.sha1(data).hexdigest()}"'
        self._send(200, data, headers, head=head)

    def _blob(self, path: str, head: bool) -> None:
        oid = path.rpartition("/")[2]
        file = self.hub.blobs.get(oid)
        if file is None:
            self._send(404, b"no such blob")
            return
        size = file.stat().st_size
        wanted = self.headers.get("Range")
        if wanted is None:
            start, end, status = 0, size - 1, 200
        else:
            first, _, last = wanted.removeprefix("bytes=").partition("-")
            start, end = int(first), min(int(last) if last else size - 1, size - 1)
            status = 206
        headers = {"ETag": f'"{oid}"', "Accept-Ranges": "bytes"}
        if status == 206:
            headers["Content-Range"] = f"bytes {start}-{end}/{size}"
        with file.open("rb") as f:
            f.seek(start)
            data = f.read(end - start + 1)
        cut = None
        if wanted is not None and not head:
            with self.hub.lock:
                plan = self.hub.cuts.get(file.name)
                if plan is not None and plan[0] > 0:
                    plan[0] -= 1
                elif plan is not None:
                    cut = self.hub.cuts.pop(file.name)[1]
        self._logged_path = file.name
        held = self.hub.holds.get(file.name) if wanted is not None and not head else None
        if held is not None and held.skip > 0:
            held.skip, held = held.skip - 1, None
        if held is not None:
            del self.hub.holds[file.name]
            self._send_held(status, data, headers, held)
            return
        self._send(status, data, headers, head=head, cut_after=cut)

    # -- sending --

    def _send_held(self, status: int, body: bytes, headers: dict, held: threading.Event) -> None:
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body[: len(body) // 2])
        self.wfile.flush()
        held.set()
        self.hub.release.wait(60)
        self.wfile.write(body[len(body) // 2 :])

    def _error(self, status: int, code: str, message: str) -> None:
        body = json.dumps({"error": message}).encode()
        self._send(status, body, {"X-Error-Code": code, "X-Error-Message": message})

    def _send(
        self,
        status: int,
        body: bytes,
        headers: dict | None = None,
        *,
        head: bool = False,
        cut_after: int | None = None,
    ) -> None:
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        sent = 0
        if not head:
            payload = body if cut_after is None else body[:cut_after]
            self.wfile.write(payload)
            sent = len(payload)
        with self.hub.lock:
            self.hub.log.append(
                Served(
                    self.role,
                    self.command,
                    self._logged_path,
                    self.headers.get("Range"),
                    status,
                    sent,
                )
            )
        if cut_after is not None:
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
