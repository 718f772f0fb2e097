"""Decode and host preprocessing in worker processes, off the interpreter lock of the rank.

``DecodeProcesses`` runs ``preprocess.host_stage`` (the file decode and, with the cpu
backend, the whole preprocessing; with the gpu backend, the decode alone) in a few
worker processes, so the thread that launches the forward never waits for a decode
thread to give back the GIL. Its ``host_stage`` stands in for ``preprocess.host_stage``
(``VisionEncoder.prepare(item, host_stage=...)``): the calling thread hands one image
to an idle worker and blocks, without the GIL, until the answer; the results are the
same arrays, bit for bit, as the same function computes in this process.

Transport. Each worker has one shared-memory segment, an anonymous ``memfd`` made by
this process and handed to the worker over its socket (no name in /dev/shm: the
kernel frees it with its last descriptor and mapping, so nothing is left behind
whoever dies, and there is nothing to unlink). The worker writes an image's arrays
into it and answers where they lie; the calling thread copies them out before the
worker takes its next image, so one segment per worker is reused image after image.
A result larger than the segment makes the worker ask for a larger one, and a segment
grown past ``retain_bytes`` is swapped for a fresh one of ``segment_bytes`` at the
worker's next image. The encoded file and the small fields travel pickled.

Start. A worker is a fresh interpreter (``python -m kimi_encoder.decode_worker``: fork
and exec at once, which is safe in a multithreaded process such as a Ray replica, as
multiprocessing's spawn is, without spawn re-running the parent's main script) with
one torch thread. The pool waits until every worker has answered once.

Failures. An image the worker cannot decode raises the exception ``host_stage``
raised there: the same type and message. A worker that dies (killed, crashed) fails
the one image it held with ``DecodeWorkerDied``, and a new worker takes its place at
once. ``close`` ends the workers; a worker whose parent died sees its socket close
and exits.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

from . import preprocess as pp
from .decode_worker import Gone, Segment, recv_message, send_message, unpack
from .items import DeferredPreprocessing

MEMFD_NAME = "kimi-encoder-decode"  # how a segment shows in /proc/<pid>/fd and maps
_MIB = 1 << 20


class DecodeWorkerDied(RuntimeError):
    """The worker process decoding an image died before answering (killed, crashed)."""


# --- the pool --------------------------------------------------------------------------


def _worker_env() -> dict[str, str]:
    """This process's environment, with this package importable and one OpenMP thread."""
    root = str(Path(__file__).resolve().parents[1])
    path = os.environ.get("PYTHONPATH")
    return {
        **os.environ,
        "PYTHONPATH": root if not path else root + os.pathsep + path,
        "OMP_NUM_THREADS": "1",
    }


def _exit_text(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


class _Worker:
    """One worker process, its socket and its segment (which outlives the process)."""

    def __init__(self, segment_bytes: int):
        self.segment = Segment(segment_bytes)
        self.proc: subprocess.Popen | None = None
        self.sock: socket.socket | None = None
        self.holding = False  # an image was sent and its answer has not come
        try:
            self.start()
        except BaseException:
            self.segment.close()
            raise

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def start(self) -> None:
        parent, child = socket.socketpair()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kimi_encoder.decode_worker", str(child.fileno())],
                pass_fds=(child.fileno(),),
                stdin=subprocess.DEVNULL,
                env=_worker_env(),
            )
        except BaseException:
            parent.close()
            raise
        finally:
            child.close()  # the child's copy is its own: EOF here when it dies
        self.sock = parent
        self._send_segment()

    def _send_segment(self) -> None:
        send_message(self.sock, ("segment", self.segment.size))
        socket.send_fds(self.sock, [b"s"], [self.segment.fd])

    def new_segment(self, size: int) -> None:
        """A fresh segment of ``size`` bytes for this worker (the old one is freed when the
        worker maps the new one)."""
        segment = Segment(size)
        self.segment.close()
        self.segment = segment
        self._send_segment()

    def ping(self, timeout_s: float) -> None:
        assert self.sock is not None, "ping before start"
        assert self.proc is not None, "ping before start"
        self.sock.settimeout(timeout_s)
        try:
            send_message(self.sock, ("ping",))
            answer = recv_message(self.sock)
        except TimeoutError:
            raise RuntimeError(
                f"decode worker process {self.proc.pid} did not answer within {timeout_s:.0f} s "
                "of its start; the machine may be overloaded: use ranks.batching.decode: "
                "threads, or fewer decode_threads."
            ) from None
        except (EOFError, OSError):
            raise RuntimeError(
                f"decode worker process {self.proc.pid} {_exit_text(self.reap())} at its "
                "start (its error is in this process's log); use ranks.batching.decode: "
                "threads until it starts."
            ) from None
        finally:
            self.sock.settimeout(None)
        assert answer == ("pong", self.proc.pid), answer

    def send(
        self, data: bytes, cfg: DeferredPreprocessing, patch: int, retain: int, fresh: int
    ) -> None:
        """One image to this worker (started first if its last start failed); a segment
        grown past ``retain`` bytes is swapped for one of ``fresh`` bytes first."""
        try:
            if self.sock is None:
                self.start()
            if self.segment.size > retain:
                self.new_segment(fresh)
            send_message(self.sock, ("job", data, cfg, patch))
        except OSError as exc:
            raise Gone() from exc

    def answer(self) -> pp.HostStage:
        """The answer to the image sent: its host-stage output, or its error raised."""
        try:
            while True:
                message = recv_message(self.sock)
                if message[0] != "grow":
                    break
                self.new_segment(max(2 * self.segment.size, -(-message[1] // _MIB) * _MIB))
        except (EOFError, OSError) as exc:
            raise Gone() from exc
        if message[0] == "error":
            raise message[1]
        _, fields, places = message
        return unpack(fields, [self.segment.read(place) for place in places])

    def reap(self, timeout_s: float = 10.0) -> int | None:
        """The exit code of a process whose socket closed (killed if it lingers)."""
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def stop(self) -> None:
        """Close the socket (the worker exits when it reads the end) and reap it."""
        if self.sock is not None:
            with contextlib.suppress(OSError):  # already disconnected
                self.sock.shutdown(socket.SHUT_RDWR)
            self.sock.close()
            self.sock = None
        self.reap()

    def close(self) -> None:
        self.stop()
        self.segment.close()


def _closed() -> RuntimeError:
    return RuntimeError("the decode worker processes were closed (the rank is stopping).")


class DecodeProcesses:
    """``count`` worker processes running ``preprocess.host_stage``; see the module doc.

    Thread-safe: each call takes an idle worker (waiting for one if all are busy), so a
    pool of ``count`` calling threads keeps every worker busy.
    """

    def __init__(
        self,
        count: int,
        *,
        segment_bytes: int = 8 * _MIB,
        retain_bytes: int = 64 * _MIB,
        start_timeout_s: float = 120.0,
    ):
        if count < 1:
            raise ValueError(f"DecodeProcesses needs at least 1 worker, got {count}.")
        if not hasattr(os, "memfd_create"):
            raise RuntimeError(
                "decode worker processes need os.memfd_create (Linux) for their shared "
                "memory; use ranks.batching.decode: threads on this platform."
            )
        self.segment_bytes = segment_bytes
        self.retain_bytes = retain_bytes
        self.images = 0  # answered with pixels
        self.errors = 0  # answered with the image's own error
        self.died = 0  # workers found dead (each replaced), holding an image or idle
        self._changed = threading.Condition()
        self._closed = False
        self._workers: list[_Worker] = []
        try:
            for _ in range(count):
                self._workers.append(_Worker(segment_bytes))
            for worker in self._workers:
                worker.ping(start_timeout_s)
        except BaseException:
            for worker in self._workers:
                worker.close()
            raise
        self._idle = list(self._workers)

    def host_stage(self, data: bytes, cfg: DeferredPreprocessing, patch: int) -> pp.HostStage:
        """``preprocess.host_stage(data, cfg, patch)``, run by a worker process."""
        worker = self._take()
        try:
            self._send(worker, data, cfg, patch)
            with self._changed:
                worker.holding = True
                self._changed.notify_all()
            try:
                host = worker.answer()
            except Gone:
                raise self._replace(worker) from None
            except Exception:
                self._count("errors")
                raise
        finally:
            self._give_back(worker)
        self._count("images")
        return host

    def _count(self, counter: str) -> None:
        with self._changed:  # calls run on several threads
            setattr(self, counter, getattr(self, counter) + 1)

    def _send(self, worker: _Worker, data: bytes, cfg: DeferredPreprocessing, patch: int) -> None:
        """The image to ``worker``; one that died while idle held nothing: a new one
        takes the image."""
        try:
            worker.send(data, cfg, patch, self.retain_bytes, self.segment_bytes)
        except Gone:
            error = self._replace(worker)
            try:
                worker.send(data, cfg, patch, self.retain_bytes, self.segment_bytes)
            except Gone:
                raise error from None

    def _take(self) -> _Worker:
        with self._changed:
            while not self._idle and not self._closed:
                self._changed.wait()
            if self._closed:
                raise _closed()
            return self._idle.pop()

    def _give_back(self, worker: _Worker) -> None:
        with self._changed:
            worker.holding = False
            if self._closed:
                worker.close()
            else:
                self._idle.append(worker)
            self._changed.notify_all()

    def _replace(self, worker: _Worker) -> Exception:
        """The error of the image a dead worker held; a new worker takes its place."""
        pid, code = worker.pid, worker.reap()
        worker.stop()
        if self._closed:
            return _closed()
        self._count("died")
        try:
            worker.start()
            replaced = "a new one took its place"
        except Exception as exc:  # noqa: BLE001 - said in this image's error; next call retries
            replaced = f"starting a new one failed ({type(exc).__name__}: {exc})"
        return DecodeWorkerDied(
            f"the decode worker process (pid {pid}) {_exit_text(code)} while decoding this "
            f"image; {replaced}. Send the image again; an image that kills the decoder every "
            "time cannot be encoded."
        )

    def wait_holding(self, count: int, timeout_s: float) -> list[int]:
        """Block until ``count`` workers hold an image; their pids (for tests and tools
        that must act while images are held)."""
        with self._changed:
            done = self._changed.wait_for(
                lambda: sum(w.holding for w in self._workers) >= count, timeout_s
            )
            if not done:
                raise TimeoutError(f"{count} workers did not hold images within {timeout_s} s")
            return [w.pid for w in self._workers if w.holding]

    @property
    def pids(self) -> list[int]:
        return [w.pid for w in self._workers]

    def info(self) -> dict:
        return {
            "workers": len(self._workers),
            "pids": self.pids,
            "images": self.images,
            "errors": self.errors,
            "died": self.died,
            "segment_bytes": sum(w.segment.size for w in self._workers),
        }

    def close(self) -> None:
        """End every worker and free its segment (a busy one when its call returns)."""
        with self._changed:
            if self._closed:
                return
            self._closed = True
            idle, self._idle = self._idle, []
            busy = [w for w in self._workers if w not in idle]
            self._changed.notify_all()
        for worker in busy:  # their calls see the socket close and give them back
            with contextlib.suppress(AttributeError, OSError):  # None: between two processes
                worker.sock.shutdown(socket.SHUT_RDWR)
        for worker in idle:
            worker.close()

    def __enter__(self) -> DecodeProcesses:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
