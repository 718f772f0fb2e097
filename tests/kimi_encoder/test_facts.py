"""Facts with one home: the dtype names are spelled in ``kimi_encoder/features.py`` only.

Everything else (the config, the request schema, the CLI, the encoder, the sglang
frames) takes them from there, so a fourth dtype is one edit. Prose may mention a
dtype; code may not spell one, and no text lists them all.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from kimi_encoder.features import FEATURE_DTYPES

ROOT = Path(__file__).resolve().parents[2]
HOME = ROOT / "kimi_encoder" / "features.py"
PACKAGES = ("kimi_encoder", "deployments")


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def spelled_dtypes(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every string constant of ``path`` (docstrings aside) that is a
    dtype name, or that names every dtype (a list of them written out as prose)."""
    tree = ast.parse(path.read_text())
    skip = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Constant) or not isinstance(node.value, str):
            continue
        if id(node) in skip:
            continue
        if node.value in FEATURE_DTYPES or all(
            re.search(rf"\b{d}\b", node.value) for d in FEATURE_DTYPES
        ):
            found.append((node.lineno, node.value))
    return sorted(found)


def test_the_dtype_names_live_in_features_only():
    files = [p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))]
    assert HOME in files
    spelled = [
        f"{path.relative_to(ROOT)}:{line}: {text!r}"
        for path in files
        if path != HOME
        for line, text in spelled_dtypes(path)
    ]
    assert not spelled, "dtype names spelled outside kimi_encoder/features.py:\n" + "\n".join(
        spelled
    )


def test_the_guard_sees_a_spelled_dtype(tmp_path):
    module = tmp_path / "m.py"
    module.write_text(
        '"""Docstrings may say float32."""\n'
        'CHOICES = ["float32", "bfloat16"]\n'
        'HELP = "float32, bfloat16 or float16"\n'
        'NOTE = "kept in float32"\n'
        'WORDS = "bfloat16 words of float32 values"\n'
    )
    assert spelled_dtypes(module) == [
        (2, "bfloat16"),
        (2, "float32"),
        (3, "float32, bfloat16 or float16"),
    ]
