"""The settings table of docs/api.md, made from the fields themselves: every leaf of
``AppArgs`` one row, its default and its description. ``python -m deployments.args.table``
writes it between the table's markers in docs/api.md;
tests/deployments/args/test_args_table.py fails when the page and the fields disagree."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from .app import AppArgs
from .base import Section

BEGIN = "<!-- settings: made by `python -m deployments.args.table` from the fields; do not edit -->"
END = "<!-- end of settings -->"
PAGE = Path(__file__).resolve().parents[2] / "docs" / "api.md"


def leaves(value: BaseModel | None = None, prefix: str = "") -> Iterator[tuple[str, Any, str]]:
    """(dotted path, default, description) of every setting that is not a section, the
    defaults as ``value`` (``AppArgs()``) has them: a section's parent may give it other
    defaults than its own (``ranks.serve_options``)."""
    value = AppArgs() if value is None else value
    for name, field in type(value).model_fields.items():
        path, default = f"{prefix}{name}", getattr(value, name)
        if isinstance(default, Section):
            yield from leaves(default, f"{path}.")
        else:
            yield path, default, field.description or ""


def shown(value: Any) -> str:
    """A default as a config writes it."""
    if isinstance(value, BaseModel):
        value = value.model_dump()
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return json.dumps(value) if isinstance(value, (list, dict, str)) else str(value)


def markdown() -> str:
    rows = ["| setting | default | meaning |", "|---|---|---|"]
    for path, default, description in leaves():
        meaning = " ".join(description.split()).replace("|", "\\|")
        rows.append(f"| `{path}` | `{shown(default)}` | {meaning} |")
    return "\n".join([BEGIN, *rows, END])


def on_page(text: str) -> str:
    """The table as the page has it (between the markers)."""
    start, end = text.index(BEGIN), text.index(END) + len(END)
    return text[start:end]


def main() -> int:
    text = PAGE.read_text()
    PAGE.write_text(text.replace(on_page(text), markdown()))
    print(f"wrote {sum(1 for _ in leaves())} settings into {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
