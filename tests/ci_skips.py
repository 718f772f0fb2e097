"""The CI skip gate: with ``CI=true`` a skipped test is one that cannot fail, so the run
fails on any skip but those for hardware that CI's machines lack (``ALLOWED``, as the CUDA
tests word their reasons), and names each such test with its reason. Without ``CI=true``
a skip is only a skip (a machine without Chromium or Prometheus still runs the rest).

``tests/conftest.py`` registers it; ``pytest -p ci_skips`` loads it alone (its test). The
engines' own tests run under ``make interop``, outside the project's conftest.
"""

from __future__ import annotations

import os

import pytest

ALLOWED = ("needs a CUDA device", "needs varlen_attn on ")


class CiSkipGate:
    """Collects the skips CI does not allow and fails the session on them. A plugin of its
    own rather than conftest hooks: those would not see the reports of the packages'
    doctests (outside tests/) in one process. Under pytest-xdist it runs in the controller,
    which sees every worker's reports."""

    def __init__(self) -> None:
        self.skips: list[tuple[str, str]] = []

    def _check(self, report) -> None:
        if not report.skipped or hasattr(report, "wasxfail"):
            return
        longrepr = report.longrepr  # (path, line, "Skipped: reason"); a list after xdist
        text = longrepr[2] if isinstance(longrepr, (tuple, list)) else str(longrepr)
        reason = text.removeprefix("Skipped: ")
        if not reason.startswith(ALLOWED):
            self.skips.append((report.nodeid, reason))

    def pytest_collectreport(self, report) -> None:  # a module skipped as a whole
        self._check(report)

    def pytest_runtest_logreport(self, report) -> None:
        self._check(report)

    def pytest_sessionfinish(self, session) -> None:
        passing = (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED)
        if self.skips and session.exitstatus in passing:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.skips:
            return
        terminalreporter.write_sep("=", f"CI=true: {len(self.skips)} skipped", red=True)
        terminalreporter.write_line(
            "In CI only a missing CUDA device may skip a test (tests/ci_skips.py, ALLOWED); "
            "install what these need, or make them run:"
        )
        for nodeid, reason in self.skips:
            terminalreporter.write_line(f"  {nodeid}: {reason}")


def register(config) -> None:
    """Register the gate where ``CI=true``, in the controller (not in xdist's workers)."""
    if os.environ.get("CI") == "true" and not hasattr(config, "workerinput"):
        config.pluginmanager.register(CiSkipGate(), "ci-skip-gate")


pytest_configure = register  # loaded as a plugin of its own: `pytest -p ci_skips`
