"""docs/api.md's settings table against the fields (deployments/args/table.py): every leaf
of ``AppArgs`` has its row, with its default and its description, and every row is a
leaf. Regenerate with ``python -m deployments.args.table``."""

from __future__ import annotations

import re

from deployments.args import AppArgs
from deployments.args.table import PAGE, leaves, markdown, on_page


def test_the_page_has_the_table_the_fields_make():
    assert on_page(PAGE.read_text()) == markdown(), (
        "docs/api.md's settings table differs from the fields: run "
        "`python -m deployments.args.table`"
    )


def test_every_leaf_has_a_row_and_every_row_is_a_leaf():
    rows = re.findall(r"^\| `([\w.]+)` \|", on_page(PAGE.read_text()), re.MULTILINE)
    paths = [path for path, _, _ in leaves()]
    assert rows == paths
    assert len(paths) == len(set(paths)) > 60
    for path in paths:  # each a field that a config can set, down its sections
        value = AppArgs()
        for part in path.split("."):
            assert part in type(value).model_fields, path
            value = getattr(value, part)
    described = [path for path, _, description in leaves() if len(description) < 10]
    assert described == [], "fields without a description"
