"""What every benchmark records: repeats and their spread, sections, reports, tables.

Every figure that compares setups is measured as repeats that alternate the
setups (A B A B ...), so a burst of load from elsewhere on the machine falls
on all of them; a ratio is the median of the per-repeat ratios, printed with
their min–max.

A ``Section`` is one part of what a run reports: its paragraphs and tables for
the page ``make bench`` writes (benchmarks/page.py), or, in a budgeted device
run (gpu_check.py, gpu_served.py), its deadline, status, checks and results as
they come. A ``Report`` keeps a device run's sections and writes them to its
output folder as JSON and Markdown after every entry, so a run killed midway
keeps what it measured; ``Report.run`` runs one section under its deadline
(``run_section``: what a section's own process runs too, benchmarks/isolated.py).
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import signal
import statistics
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def fmt_load(load: Sequence[float]) -> str:
    return "/".join(f"{v:.2f}" for v in load)


def say(*args) -> None:
    """Progress lines that arrive even without PYTHONUNBUFFERED."""
    print(*args, flush=True)


# --- repeats and their spread ---------------------------------------------------------


@dataclass(frozen=True)
class Spread:
    """Repeated measurements of one figure: the median and the min–max."""

    values: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    @property
    def lo(self) -> float:
        return min(self.values)

    @property
    def hi(self) -> float:
        return max(self.values)

    def fmt(self, digits: int = 2, unit: str = "") -> str:
        """``1.83x (1.79–1.88)``: the median, then the min–max."""
        return f"{self.median:.{digits}f}{unit} ({self.lo:.{digits}f}–{self.hi:.{digits}f})"

    def overlaps(self, other: Spread) -> bool:
        """Whether the two min–max ranges share a value (the runs agree within their spreads)."""
        return self.lo <= other.hi and other.lo <= self.hi

    def holds_median_of(self, other: Spread) -> bool:
        """Whether each median lies within the other's min–max (the stricter check)."""
        return self.lo <= other.median <= self.hi and other.lo <= self.median <= other.hi


def spread(values: Sequence[float]) -> Spread:
    if not values:
        raise ValueError("a spread needs at least one value, got none.")
    return Spread(tuple(float(v) for v in values))


def line_through(x: Sequence[float], y: Sequence[float]) -> tuple[float, float]:
    """(value at x = 0, slope) of the line through the two points (x[0], y[0]), (x[1], y[1])."""
    slope = (y[0] - y[1]) / (x[0] - x[1]) + 0.0  # a flat line's slope prints as 0.00, not -0.00
    return y[1] - slope * x[1], slope


def ratio(numerator: Sequence[float], denominator: Sequence[float]) -> Spread:
    """Per-repeat ratios of two setups measured in the same repeats."""
    return spread([a / b for a, b in zip(numerator, denominator, strict=True)])


# Windows measured again after a failure ``alternate`` was told to survive, as
# "setup, repeat k: error"; ``page.with_load`` moves them onto the page, under their section.
RERUNS: list[str] = []


def alternate(
    setups: Mapping[str, Callable[[], T]],
    repeats: int,
    rerun_if: Callable[[BaseException], bool] = lambda exc: False,
) -> dict[str, list[T]]:
    """Run every setup once per repeat, in the same order each time (A B C A B C ...).

    A window that fails with an error ``rerun_if`` accepts (a served window whose
    replica died under it, say) is measured once more and noted in ``RERUNS``; a
    second failure of the same window is raised.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}.")
    out: dict[str, list[T]] = {name: [] for name in setups}
    for repeat in range(repeats):
        for name, measure in setups.items():
            try:
                value = measure()
            except Exception as exc:
                if not rerun_if(exc):
                    raise
                RERUNS.append(f"{name}, repeat {repeat + 1}: {type(exc).__name__}: {exc}")
                value = measure()
            out[name].append(value)
    return out


# --- sections -------------------------------------------------------------------------


def table(header: Sequence[str], rows: Sequence[Sequence]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


@dataclass
class Section:
    """One section of a report: its title, the command that re-runs it alone, and its
    paragraphs and tables in order. A budgeted section (``deadline_s`` set) also
    records, as it runs, its checks, results and notes; ``results`` fills entry by
    entry, so a timeout keeps what was measured."""

    title: str
    command: str = ""
    parts: list[str] = field(default_factory=list)
    load: tuple[tuple[float, ...], tuple[float, ...]] | None = None  # before, after
    deadline_s: float | None = None
    status: str = "running"
    elapsed_s: float = 0.0
    checks: list[dict] = field(default_factory=list)
    results: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    error: str | None = None
    _started: float = field(default_factory=time.monotonic)
    _save: Callable[[Section], None] | None = None  # writes the report after each entry

    def left(self) -> float:
        """Seconds left of the deadline (unbounded without one)."""
        if self.deadline_s is None:
            return math.inf
        return self.deadline_s - (time.monotonic() - self._started)

    def fits(self, what: str, needs_s: float) -> bool:
        """Whether ``what`` (about ``needs_s`` seconds) still fits the deadline; notes a skip."""
        if self.left() >= needs_s:
            return True
        self.notes.append(f"skipped {what}: {self.left():.0f} s left of the section's deadline")
        self._saved()
        return False

    def check(self, name: str, passed: bool | None, **detail) -> None:
        """A pass/fail check (``passed`` None: skipped, with ``reason`` in ``detail``)."""
        status = "skipped" if passed is None else ("pass" if passed else "fail")
        self.checks.append({"name": name, "status": status, **detail})
        say(f"  [{status}] {name} {brief(detail)}")
        self._saved()

    def record(self, key: str, value) -> None:
        self.results[key] = value
        say(f"  {key}: {brief(value)}")
        self._saved()

    def note(self, text: str) -> None:
        self.notes.append(text)
        say(f"  note: {text}")
        self._saved()

    def _saved(self) -> None:
        if self._save is not None:
            self._save(self)

    @classmethod
    def from_dict(cls, data: dict) -> Section:
        """A section as ``as_dict`` wrote it (a device run's child hands its section over
        so: benchmarks/isolated.py)."""
        fields = ("deadline_s", "status", "elapsed_s", "checks", "results", "notes", "error")
        return cls(data["name"], **{key: data[key] for key in fields if key in data})

    def as_dict(self) -> dict:
        out = {"name": self.title}
        out |= {k: v for k, v in self.__dict__.items() if not k.startswith("_")}
        for key in ("title", "command", "parts", "load"):
            out.pop(key)
        return rounded(out)

    def markdown(self, number: int | None = None) -> str:
        title = f"{number}. {self.title}" if number is not None else self.title
        if self.deadline_s is not None:
            title += f": {self.status} ({round(self.elapsed_s, 1)} s)"
        lines = [f"## {title}", ""]
        if self.command:
            lines.append(f"Re-run alone: `{self.command}`")
            if self.load:
                before, after = self.load
                lines[-1] += f" (load average before {fmt_load(before)}, after {fmt_load(after)})"
            lines.append("")
        for part in self.parts:
            lines += [part, ""]
        record = self._record_lines()
        if record[:1] == [""]:  # a table's blank line follows the title's
            record = record[1:]
        return "\n".join(lines + record + ([""] if record else []))

    def _record_lines(self) -> list[str]:
        lines = []
        for check in self.checks:
            detail = {k: v for k, v in check.items() if k not in ("name", "status")}
            lines.append(f"- **{check['status']}** {check['name']}: {brief(detail, 400)}")
        for key, value in self.results.items():
            if not isinstance(value, dict):
                lines.append(f"- {key}: {brief(value, 600)}")
        lines += [f"- note: {note}" for note in self.notes]
        rows = {k: v for k, v in self.results.items() if isinstance(v, dict) and not nested(v)}
        lines += tables({k: flat(v) for k, v in rows.items()})
        for key, value in self.results.items():
            if isinstance(value, dict) and nested(value):
                lines += ["", f"{key}:", *tables({k: flat(v) for k, v in value.items()})]
        if self.error:
            lines += ["", "```", self.error, "```"]
        return lines


# --- budgeted reports -----------------------------------------------------------------


class SectionTimeout(Exception):
    pass


class Skip(Exception):
    """Raised by a section that cannot run here; its message says why."""


@contextlib.contextmanager
def alarm(seconds: float) -> Iterator[None]:
    """Raise SectionTimeout in the main thread after ``seconds`` (a backstop: sections
    also check their deadline between steps; a running CUDA call finishes first)."""

    def fire(signum, frame):
        raise SectionTimeout(f"deadline of {seconds:.0f} s passed")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_section(section: Section, fn: Callable[[Section], None], alarm_s: float) -> None:
    """``fn(section)`` with the section's status set from how it ended: a failed check
    fails it; ``Skip`` skips it with its reason; ``SectionTimeout`` (the alarm, ``alarm_s``
    from now) is a timeout; another exception is recorded as an error."""
    try:
        with alarm(alarm_s):
            fn(section)
        failed = any(c["status"] == "fail" for c in section.checks)
        section.status = "fail" if failed else "pass"
    except SectionTimeout as exc:
        section.status = "timeout"
        section.error = str(exc)
    except Skip as exc:
        section.status = f"skipped: {exc}"
        say(f"  {section.status}")
    except Exception as exc:  # noqa: BLE001 - recorded; the next sections still run
        section.status = "error"
        section.error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=8)}"
        say(section.error)


class Report:
    """A budgeted run's record: ``data`` (what the run was measured on) and its sections,
    written to ``out`` as ``{name}.json`` and ``{name}.md`` after every entry."""

    RESERVE_S = 10.0  # left at the end of the budget for writing and exiting
    GRACE_S = 15.0  # past a section's deadline before the alarm interrupts it

    def __init__(
        self,
        out: Path,
        name: str,
        title: str,
        data: dict,
        budget_s: float,
        intro: Callable[[dict], list[str]] = lambda data: [],
    ):
        self.out, self.name, self.title, self.intro = out, name, title, intro
        self.started = time.monotonic()
        self.budget_s = budget_s
        self.data = {**data, "budget_s": budget_s, "sections": {}}
        self.sections: dict[str, Section] = {}

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)

    def run(
        self, name: str, fn: Callable[[Section], None], deadline_s: float, min_s: float
    ) -> Section:
        """``fn(section)`` under the lower of ``deadline_s`` and what the budget has left;
        skipped, saying so, when fewer than ``min_s`` seconds are left. A failed check
        fails the section; ``Skip`` skips it with its reason; another exception is
        recorded and the run goes on."""
        left = self.left() - self.RESERVE_S
        section = Section(name, deadline_s=min(deadline_s, left), _save=self.save_section)
        self.save_section(section)
        say(f"== {name} (deadline {section.deadline_s:.0f} s, budget left {self.left():.0f} s)")
        if left < min_s:
            section.status = f"skipped: {left:.0f} s of the budget left, it needs {min_s:.0f}"
            say(f"  {section.status}")
        else:
            run_section(section, fn, section.deadline_s + self.GRACE_S)
        section.elapsed_s = section.deadline_s - section.left()
        self.save_section(section)
        say(f"== {name}: {section.status} in {section.elapsed_s:.1f} s")
        gc.collect()
        return section

    def save_section(self, section: Section) -> None:
        self.data["sections"][section.title] = section.as_dict()
        self.sections[section.title] = section
        self.write()

    def write(self) -> None:
        self.data["elapsed_s"] = round(time.monotonic() - self.started, 1)
        self.data["exit_code"] = self.exit_code()
        self.out.mkdir(parents=True, exist_ok=True)
        for name, text in (
            (f"{self.name}.json", json.dumps(rounded(self.data), indent=2, default=str)),
            (f"{self.name}.md", self.markdown()),
        ):
            tmp = self.out / f".{name}.tmp"
            tmp.write_text(text + "\n")
            tmp.replace(self.out / name)

    def exit_code(self) -> int:
        """1 when a check failed or a section raised, else 0."""
        return int(any(s["status"] in ("fail", "error") for s in self.data["sections"].values()))

    def markdown(self) -> str:
        data = self.data
        lines = [f"# {self.title}", "", *self.intro(data)]
        lines += [
            f"budget {data['budget_s']} s, elapsed {data.get('elapsed_s')} s, "
            f"exit code {data.get('exit_code')}",
            "",
        ]
        lines += [section.markdown() for section in self.sections.values()]
        return "\n".join(lines)


# --- rendering records ----------------------------------------------------------------


def nested(value: dict) -> bool:
    """A dict of rows (each a dict), rendered as a table of its own."""
    return bool(value) and all(isinstance(v, dict) for v in value.values())


def tables(rows: dict[str, dict]) -> list[str]:
    """Markdown tables: one per distinct set of columns, a row per entry."""
    lines = []
    for columns in dict.fromkeys(tuple(row) for row in rows.values()):
        lines += ["", "| | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
        for key, row in rows.items():
            if tuple(row) == columns:
                cells = [brief(row[c], 80) for c in columns]
                lines.append("| " + " | ".join([key, *cells]).replace("\n", " ") + " |")
    return lines


def flat(row: dict, prefix: str = "") -> dict:
    """One level of nesting spelled out: {"a": {"b": 1}} -> {"a.b": 1}."""
    out = {}
    for key, value in row.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def rounded(value):
    """Floats to 4 significant digits (non-finite ones as text), through dicts and lists."""
    if isinstance(value, float):
        return float(f"{value:.4g}") if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return {str(k): rounded(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [rounded(v) for v in value]
    return value


def brief(value, limit: int = 240) -> str:
    text = json.dumps(rounded(value), default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."
