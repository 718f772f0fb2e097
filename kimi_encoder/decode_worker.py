"""A decode worker process (``decode_procs.DecodeProcesses`` starts it), and the wire both
sides speak: pickled messages with a length header on a socket pair, arrays in a
shared-memory segment whose descriptor travels over the socket."""

from __future__ import annotations

import mmap
import os
import pickle
import signal
import socket
import struct
import sys

import numpy as np
import torch

from . import preprocess as pp
from .items import DeferredPreprocessing

_HEADER = struct.Struct("!Q")  # length of the pickled message that follows
_ALIGN = 64  # arrays start on cache lines in a segment
_MIB = 1 << 20
MEMFD_NAME = "kimi-encoder-decode"  # how a segment shows in /proc/<pid>/fd and maps


class Gone(Exception):
    """The worker's socket closed: it died (or the pool was closed under it)."""


# --- messages and segments -------------------------------------------------------------


def send_message(sock: socket.socket, message: tuple) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_HEADER.pack(len(data)))
    sock.sendall(data)


def recv_message(sock: socket.socket) -> tuple:
    (size,) = _HEADER.unpack(recv_exact(sock, _HEADER.size))
    return pickle.loads(recv_exact(sock, size))


def recv_exact(sock: socket.socket, size: int) -> bytearray:
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise EOFError("the socket closed")
        got += n
    return buf


def aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


class Segment:
    """One anonymous shared-memory segment (a memfd) of ``size`` bytes, mapped here."""

    def __init__(self, size: int, fd: int | None = None):
        self.size = size
        self.fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC) if fd is None else fd
        try:
            if fd is None:
                os.ftruncate(self.fd, size)
            self.map = mmap.mmap(self.fd, size)
        except BaseException:
            os.close(self.fd)
            raise

    def write(self, arrays: list[np.ndarray]) -> list[tuple[int, str, tuple[int, ...]]]:
        """Each array copied in, one after the other; (offset, dtype, shape) of each."""
        places, offset = [], 0
        for array in arrays:
            target = np.ndarray(array.shape, array.dtype, buffer=self.map, offset=offset)
            np.copyto(target, array)
            places.append((offset, array.dtype.str, array.shape))
            offset = aligned(offset + array.nbytes)
        return places

    def read(self, place: tuple[int, str, tuple[int, ...]]) -> np.ndarray:
        """A copy of the array at ``place`` (the segment is written again next image)."""
        offset, dtype, shape = place
        view = np.ndarray(shape, np.dtype(dtype), buffer=self.map, offset=offset)
        try:
            return view.copy()
        finally:
            del view  # the map cannot close while a view of it lives

    def close(self) -> None:
        self.map.close()
        os.close(self.fd)


def needed_bytes(arrays: list[np.ndarray]) -> int:
    return sum(aligned(array.nbytes) for array in arrays)


def pack(host: pp.HostStage) -> tuple[tuple, list[np.ndarray]]:
    """``host_stage``'s output as (small fields, arrays)."""
    if isinstance(host, pp.HostImage):
        arrays = [host.pixels] + ([] if host.palette is None else [host.palette])
        fields = ("image", host.mode, host.transparency, host.finished, host.palette is not None)
        return fields, [np.ascontiguousarray(a) for a in arrays]
    pixels, grid = host
    return ("patches", grid), [pixels.contiguous().numpy()]


def unpack(fields: tuple, arrays: list[np.ndarray]) -> pp.HostStage:
    if fields[0] == "image":
        _, mode, transparency, finished, has_palette = fields
        palette = arrays[1] if has_palette else None
        return pp.HostImage(arrays[0], mode, palette, transparency, finished)
    return torch.from_numpy(arrays[0]), fields[1]


def portable_error(exc: Exception) -> Exception:
    """``exc`` if it survives pickling (the library's errors do), else a RuntimeError
    naming it."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:  # noqa: BLE001 - any exception that cannot cross processes
        return RuntimeError(f"{type(exc).__name__}: {exc}")
    return exc


# --- the worker process ----------------------------------------------------------------


class WorkerLoop:
    """What a worker process runs: messages in, answers out, until its socket closes."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.segment: Segment | None = None

    def run(self) -> None:
        try:
            while True:
                self._handle(recv_message(self.sock))
        except (EOFError, ConnectionError):
            return  # the pool closed this socket (maybe mid-image), or its process died

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "segment":
            self._attach(message[1])
        elif kind == "ping":
            send_message(self.sock, ("pong", os.getpid()))
        elif kind == "job":
            send_message(self.sock, self._job(*message[1:]))
        else:
            raise ValueError(f"unknown message {kind!r}")

    def _attach(self, size: int) -> None:
        """Map the segment whose descriptor follows the message."""
        _, fds, _, _ = socket.recv_fds(self.sock, 1, 1)
        if self.segment is not None:
            self.segment.close()
        self.segment = Segment(size, fds[0])

    def _job(self, data: bytes, cfg: DeferredPreprocessing, patch: int) -> tuple:
        try:
            fields, arrays = pack(pp.host_stage(data, cfg, patch))
        except Exception as exc:  # noqa: BLE001 - the image's own error, answered as is
            return ("error", portable_error(exc))
        need = needed_bytes(arrays)
        if self.segment is None or need > self.segment.size:
            send_message(self.sock, ("grow", need))
            message = recv_message(self.sock)
            assert message[0] == "segment", message
            self._attach(message[1])
        return ("done", fields, self.segment.write(arrays))


def serve(fd: int) -> None:
    """A worker process's main: one torch thread; Ctrl-C is its parent's to handle."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)
    WorkerLoop(socket.socket(fileno=fd)).run()


if __name__ == "__main__":
    serve(int(sys.argv[1]))
