"""The CI skip gate (tests/ci_skips.py): with ``CI=true`` a run fails on any skip but a
missing CUDA device's, and names each such test with its reason; without it, skips are
only skips.

Each case runs pytest in a subprocess on a tiny module of its own, outside the project,
with the gate loaded as a plugin (``-p ci_skips``, as tests/conftest.py registers it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

UNRELATED = """
import pytest

def test_passes():
    pass

def test_needs_a_tool():
    pytest.skip("no frobnicator installed")
"""

CUDA = """
import pytest

def test_passes():
    pass

@pytest.mark.skipif(True, reason="needs a CUDA device")
def test_on_a_gpu():
    pass

def test_varlen():
    pytest.skip("needs varlen_attn on an sm80+ GPU")
"""

MODULE = """
import pytest

pytest.importorskip("no_such_module_here")

def test_never_collected():
    pass
"""

DOCTEST = '''
def double(x):
    """
    >>> double(2)  # doctest: +SKIP
    4
    """
    return 2 * x
'''

# (module source, CI, extra pytest args, exit status, lines the output must hold)
CASES = {
    "unrelated-skip-fails": (
        UNRELATED,
        "true",
        [],
        1,
        ["CI=true: 1 skipped", "test_gate.py::test_needs_a_tool: no frobnicator installed"],
    ),
    "unrelated-skip-fails-under-xdist": (
        UNRELATED,
        "true",
        ["-n", "2"],
        1,
        ["test_gate.py::test_needs_a_tool: no frobnicator installed"],
    ),
    "module-skip-fails": (
        MODULE,
        "true",
        [],
        1,
        ["test_gate.py: could not import 'no_such_module_here'"],
    ),
    "doctest-skip-fails": (
        DOCTEST,
        "true",
        ["--doctest-modules"],
        1,
        ["test_gate.py::test_gate.double: all tests skipped by +SKIP option"],
    ),
    "cuda-skips-pass": (CUDA, "true", [], 0, ["1 passed, 2 skipped"]),
    "no-ci-skips-are-skips": (UNRELATED, None, [], 0, ["1 passed, 1 skipped"]),
}


@pytest.mark.parametrize(
    ("source", "ci", "args", "status", "expected"), CASES.values(), ids=CASES.keys()
)
def test_ci_skip_gate(tmp_path, source, ci, args, status, expected):
    (tmp_path / "test_gate.py").write_text(source)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # keeps the project's settings out
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_ADDOPTS")}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    if ci is not None:
        env["CI"] = ci
    command = [sys.executable, "-m", "pytest", "-p", "ci_skips", "-p", "no:cacheprovider"]
    done = subprocess.run(
        [*command, *args, "test_gate.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = done.stdout + done.stderr
    assert done.returncode == status, output
    for line in expected:
        assert line in output, output
    if status == 0:
        assert "CI=true:" not in output, output
