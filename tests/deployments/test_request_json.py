"""Request JSON (deployments/request_json.py) answers what the standard library answers.

The reference is ``json.loads`` with a pairs hook that refuses a repeated key, the
parser the ingress used before: every body gets the same document, or the same
refusal (the same repeated key, or the same ``JSONDecodeError`` message and place).
"""

from __future__ import annotations

import codecs
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deployments.admission import MalformedBodyError, parse_json
from deployments.request_json import (
    DuplicateKeyError,
    NestingError,
    first_duplicate_key,
    loads,
)

FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class Repeated(Exception):
    def __init__(self, key: str):
        self.key = key


def _refuse_repeats(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise Repeated(key)
        out[key] = value
    return out


def answer(parse, repeated: type[Exception], body: bytes) -> tuple[str, Any]:
    """What ``parse(body)`` does: a document, a refused repeated key (``repeated``), an
    invalid body (message and place) or undecodable bytes."""
    try:
        return "document", parse(body)
    except repeated as exc:
        return "repeated", exc.key
    except json.JSONDecodeError as exc:
        return "invalid", (exc.msg, exc.lineno, exc.colno)
    except UnicodeDecodeError as exc:
        return "undecodable", str(exc)


def reference(body: bytes) -> tuple[str, Any]:
    return answer(lambda b: json.loads(b, object_pairs_hook=_refuse_repeats), Repeated, body)


def ours(body: bytes) -> tuple[str, Any]:
    return answer(loads, DuplicateKeyError, body)


def same(a: Any, b: Any) -> bool:
    """Equal, with the same types all the way down (1 is not 1.0, -0.0 is not 0.0)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float):
        return a.hex() == b.hex()
    return a == b


def check(body: bytes) -> None:
    (kind, want), (got_kind, got) = reference(body), ours(body)
    assert got_kind == kind, (body[:200], kind, want, got_kind, got)
    assert same(got, want), (body[:200], want, got)


# --- JSON text drawn with repeated and escaped keys ----------------------------------

space = st.sampled_from(["", " ", "\n", "\t ", "\r\n  "])
KEYS = ["a", "b", "é", "ä", '"', "\\", ":", "{", "}", "a b", "", '":"', "\\u0061"]


@st.composite
def key_text(draw) -> str:
    """A key spelled as it is, as ASCII escapes, or with every character \\u-escaped."""
    key = draw(st.sampled_from(KEYS))
    style = draw(st.sampled_from(["as is", "ascii", "u"]))
    if style == "u":
        return '"' + "".join(f"\\u{ord(c):04x}" for c in key) + '"'
    return json.dumps(key, ensure_ascii=style == "ascii")


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),  # past 64 bits too: the standard library parses those
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
    st.sampled_from(['{"a": 1}', "x\\", '":', "}{", "\\u0061"]),  # JSON-looking strings
).map(lambda v: json.dumps(v, ensure_ascii=False))


def _extend(children):
    @st.composite
    def array(draw) -> str:
        items = draw(st.lists(children, max_size=4))
        return "[" + draw(space) + ("," + draw(space)).join(items) + draw(space) + "]"

    @st.composite
    def obj(draw) -> str:
        pairs = draw(st.lists(st.tuples(key_text(), children), max_size=4))
        parts = [k + draw(space) + ":" + draw(space) + v for k, v in pairs]
        return "{" + draw(space) + ("," + draw(space)).join(parts) + draw(space) + "}"

    return st.one_of(array(), obj())


documents = st.recursive(scalars, _extend, max_leaves=24)


@FUZZ
@given(documents, space, space)
def test_any_document_gets_the_standard_librarys_answer(text: str, before: str, after: str):
    check((before + text + after).encode())


@FUZZ
@given(documents, st.integers(0, 200))
def test_a_cut_document_gets_the_standard_librarys_refusal(text: str, cut: int):
    check(text.encode()[: max(0, len(text.encode()) - 1 - cut)])


# --- edge cases, by name -------------------------------------------------------------

CASES = [
    ("repeat", b'{"a": 1, "a": 2}', "repeated", "a"),
    ("escaped-repeat", b'{"a": 1, "\\u0061": 2}', "repeated", "a"),
    ("inner-object-closes-first", b'{"a": 1, "a": {"b": 1, "b": 2}}', "repeated", "b"),
    ("first-sibling-first", b'[{"x": 1, "x": 2}, {"y": 1, "y": 2}]', "repeated", "x"),
    ("earlier-repeat-in-object", b'{"b": 1, "a": 1, "b": 2, "a": 2}', "repeated", "b"),
    ("same-key-other-objects", b'{"a": {"a": 1}, "b": [{"a": 2}, {"a": 3}]}', "document", None),
    ("colon-in-string-value", b'{"a": "x", "b": ":", "c": "\\":"}', "document", None),
    ("quote-escapes", b'{"\\\\": 1, "\\"": 2, "\\\\\\"": 3, "\\\\": 4}', "repeated", "\\"),
    ("braces-in-strings", b'{"{": "}", "}": "{", "a": "}{}"}', "document", None),
    ("non-ascii-key", '{"é": 1, "\\u00e9": 2}'.encode(), "repeated", "é"),
    ("nan-only-stdlib", b'{"a": NaN, "a": 1}', "repeated", "a"),
    ("huge-int-only-stdlib", b'{"n": 123456789012345678901234567890}', "document", None),
    ("lone-surrogate-only-stdlib", b'{"s": "\\ud800"}', "document", None),
    ("byte-order-mark", codecs.BOM_UTF8 + b'{"a": 1}', "document", None),
    ("utf-16", '{"a": 1, "a": 2}'.encode("utf-16"), "repeated", "a"),
    ("invalid", b'{"items": [}', "invalid", None),
    ("trailing-comma", b'{"a": 1,}', "invalid", None),
    ("empty", b"", "invalid", None),
    ("long-string", b'{"items": [{"image": "' + b"QUJD" * 150_000 + b'"}]}', "document", None),
]


@pytest.mark.parametrize(("body", "kind", "key"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_edge_cases_get_the_standard_librarys_answer(body: bytes, kind: str, key: str | None):
    assert reference(body)[0] == kind  # the table says what the reference does
    if key is not None:
        assert reference(body)[1] == key
    check(body)


def test_the_scan_finds_no_repeat_where_there_is_none():
    body = json.dumps({"items": [{"type": "image", "image": "A" * 1000}] * 3}).encode()
    assert first_duplicate_key(body) is None


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (b'{"items": [], "items": []}', r"key 'items' more than once; send each key once"),
        (b'{"items": [}', r"not valid JSON \(Expecting value at line 1 column 12\)"),
        (b"\xff{}", r"not valid JSON|not UTF-8 JSON"),
    ],
    ids=["repeat", "invalid", "not-utf8"],
)
def test_parse_json_refuses_with_the_served_message(body: bytes, match: str):
    with pytest.raises(MalformedBodyError, match=match):
        parse_json(body)


def nested(depth: int, inside_item: bool, tail: bytes = b"") -> bytes:
    """A body nesting ``depth`` arrays at its top, or as an item's image."""
    deep = b"[" * depth + tail + b"]" * depth
    if not inside_item:
        return deep
    return b'{"items": [{"type": "image", "image": ' + deep + b"}]}"


@pytest.mark.parametrize("inside_item", [False, True], ids=["top", "in-item"])
@pytest.mark.parametrize("depth", [5_000, 100_000])
@pytest.mark.parametrize("tail", [b"", b"NaN"], ids=["plain", "stdlib-only-value"])
def test_deep_nesting_is_refused_not_a_recursion_error(depth, inside_item, tail):
    """orjson refuses past 1024 levels; the standard library's recursive parser would
    raise RecursionError (a 500), so the body is refused as too deeply nested."""
    body = nested(depth, inside_item, tail)
    with pytest.raises(NestingError, match="too deeply"):
        loads(body)
    with pytest.raises(MalformedBodyError, match="nests arrays or objects too deeply"):
        parse_json(body)


def test_nesting_orjson_reads_is_a_document():
    assert loads(nested(1000, inside_item=True))["items"][0]["type"] == "image"
