"""Each section of a device run in a process of its own (benchmarks/gpu_served.py).

A sticky CUDA error fails every later CUDA call of the process that hit it, and a CUDA
call that never returns cannot be interrupted from Python: sections sharing one process
lose everything after the first of either. So the driver, which never touches the
device, starts each section as a child process (``python <script> --child NAME``, started
afresh, never forked, in a session of its own), and

- the child runs the section under an alarm at its deadline plus half the grace
  (``common.run_section``: a timeout, an exception, a failed check or a skip recorded as
  in one process) and writes the section (``Section.as_dict``) to its own file after
  every entry: that file is the hand-off;
- the driver waits until the deadline plus the grace, then kills the child's process
  group (its client processes with it), and takes the section from the file however the
  child ended: killed, a timeout; gone without returning (a crash, a device error that
  ended the process), an error with the tail of its output. The figures written before
  either stay in the report.

Deadlines cross the process boundary as moments of ``time.monotonic``, one clock for
every process of the machine (Linux's CLOCK_MONOTONIC), so a child's imports count
against its section.

``--inject NAME=FAULT`` (hidden: the tests' rehearsal of a bad run) runs FAULT in place of
section NAME's function in its child (``FAULTS``): each records a figure first, then
hangs where no signal reaches it, raises, waits for its alarm, or ends its process.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from .common import Report, Section, run_section, say


def grace_s(deadline_s: float) -> float:
    """Seconds past a section's deadline before its child is killed: a tenth of the
    deadline, 4 to 10 (the child's own alarm fires halfway, which leaves it a second or
    more to record the timeout on a busy machine)."""
    return min(10.0, max(4.0, deadline_s / 10))


# --------------------------------------------------------------------------- the child


def child(name: str, fn: Callable[[Section], None], until: float, grace: float, path: Path) -> int:
    """Section ``name`` run as ``fn`` until ``until`` (``time.monotonic``) plus half of
    ``grace``, written to ``path`` after every entry; 0 once it is recorded, however it
    ended."""

    def save(section: Section) -> None:
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(section.as_dict(), default=str))
        tmp.replace(path)

    section = Section(name, deadline_s=until - time.monotonic(), _save=save)
    save(section)
    run_section(section, fn, section.deadline_s + grace / 2)
    section.elapsed_s = section.deadline_s - section.left()
    save(section)
    return 0


def _hang(sec: Section) -> None:
    sec.record("before the fault", 1.0)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})  # as in a CUDA call: no handler
    threading.Event().wait()


def _raise(sec: Section) -> None:
    sec.record("before the fault", 1.0)
    raise RuntimeError("injected fault: the section raised")


def _timeout(sec: Section) -> None:
    sec.record("before the fault", 1.0)
    threading.Event().wait()  # the section's alarm ends the wait


def _crash(sec: Section) -> None:
    sec.record("before the fault", 1.0)
    os._exit(3)  # gone without returning or cleaning up, as a crashed process


FAULTS: dict[str, Callable[[Section], None]] = {
    "hang": _hang,
    "raise": _raise,
    "timeout": _timeout,
    "crash": _crash,
}


def parse_pairs(values: Iterable[str], names: Iterable[str], what: str, option: str) -> dict:
    """``NAME=VALUE`` options (a section's name holds commas and spaces, never '='), by
    name; an unknown name says which are allowed."""
    names = list(names)
    out = {}
    for value in values:
        name, sep, setting = value.rpartition("=")
        if not sep or name not in names:
            raise ValueError(
                f"{option} {value!r}: expected NAME={what} with NAME one of {names}, "
                f"e.g. {option} '{names[-1]}={what}'."
            )
        out[name] = setting
    return out


def parse_faults(values: Iterable[str], names: Iterable[str]) -> dict[str, str]:
    faults = parse_pairs(values, names, "FAULT", "--inject")
    for name, fault in faults.items():
        if fault not in FAULTS:
            raise ValueError(
                f"--inject {name}={fault}: unknown fault {fault!r}; allowed: {', '.join(FAULTS)}."
            )
    return faults


# --------------------------------------------------------------------------- the driver


def run_child(
    report: Report,
    name: str,
    command: list[str],
    path: Path,
    deadline_s: float,
    min_s: float,
    env: Mapping[str, str] | None = None,
) -> Section:
    """Section ``name`` as ``command`` (a child that calls ``child``; ``--until`` and
    ``--grace`` added here) under the lower of ``deadline_s`` and what the budget has left,
    skipped when fewer than ``min_s`` seconds are left; killed at the deadline plus its
    grace; recorded from ``path`` however it ended."""
    left = report.left() - report.RESERVE_S
    started = time.monotonic()
    section = Section(name, deadline_s=min(deadline_s, left))
    report.save_section(section)
    say(f"== {name} (deadline {section.deadline_s:.0f} s, budget left {report.left():.0f} s)")
    if left < min_s:
        section.status = f"skipped: {left:.0f} s of the budget left, it needs {min_s:.0f}"
        say(f"  {section.status}")
    else:
        grace = grace_s(section.deadline_s)
        until = started + section.deadline_s
        path.unlink(missing_ok=True)
        timing = ["--until", f"{until:.3f}", "--grace", f"{grace:.1f}"]
        rc, tail = _wait([*command, *timing], until + grace, env)
        section = _recorded(section, path, rc, grace, tail)
    section.elapsed_s = time.monotonic() - started
    report.save_section(section)
    say(f"== {name}: {section.status} in {section.elapsed_s:.1f} s")
    return section


def _wait(command: list[str], kill_at: float, env) -> tuple[int | None, str]:
    """Run ``command`` in a session of its own, its output passed on as it comes, until
    it ends or ``kill_at``; then its whole process group killed. Its exit status (None:
    killed at ``kill_at``) and the tail of its output."""
    tail: deque[str] = deque(maxlen=25)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True, env=env
    )
    reader = threading.Thread(target=_pass_on, args=(process.stdout, tail), daemon=True)
    reader.start()
    try:
        rc = process.wait(timeout=max(0.0, kill_at - time.monotonic()))
    except subprocess.TimeoutExpired:
        rc = None
    finally:  # what the section started (client processes, a forkserver) goes with it
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        reader.join(5)
    return rc, "".join(tail)[-3000:]


def _pass_on(stream, tail: deque) -> None:
    for line in iter(stream.readline, b""):
        text = line.decode(errors="replace")
        sys.stdout.write(text)
        sys.stdout.flush()
        tail.append(text)


def _recorded(section: Section, path: Path, rc: int | None, grace: float, tail: str) -> Section:
    """The section as its child wrote it, its status set by how the child ended."""
    written = json.loads(path.read_text()) if path.exists() else None
    got = Section.from_dict(written) if written else Section(section.title)
    got.deadline_s = section.deadline_s
    if rc is None and got.status != "running":  # recorded, then stuck on its way out
        got.notes.append(f"its process, past its deadline, was killed {grace:.0f} s after it")
    elif rc is None:
        got.status = "timeout"
        got.error = (
            f"killed {grace:.0f} s past its deadline of {section.deadline_s:.0f} s: it had not "
            f"returned, and no alarm reached it (a call that never returns). Its last "
            f"output:\n{tail}"
        )
    elif rc != 0:
        how = f"signal {-rc}" if rc < 0 else f"exit status {rc}"
        got.status = "error"
        got.error = f"its process ended ({how}) without returning. Its last output:\n{tail}"
    elif written is None or got.status == "running":
        got.status = "error"
        got.error = f"its process returned without recording the section. Its last output:\n{tail}"
    return got
