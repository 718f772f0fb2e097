"""Request bodies as JSON: parsed by ``orjson``, with the standard library's answers.

An encode request carries its images as base64 strings: megabytes of JSON that
are almost all string, which orjson parses in about half the standard library's
time (docs/api.md, "Measurements behind the code").

``loads`` answers exactly what ``json.loads(body, object_pairs_hook=...)`` with a
hook refusing repeated keys answers:

- a body orjson refuses (invalid JSON, and what only the standard library takes:
  ``NaN``, ``1e400``, lone surrogates, UTF-16 and UTF-32, a byte-order mark,
  nesting past 1024) is parsed again by the standard library, which either
  accepts it or raises with its own message and position;
- orjson reads an integer past 64 bits as a float; a document with a float that
  large is parsed again by the standard library too, which keeps the integer;
- orjson keeps the last of repeated keys, so a body it accepts is scanned for
  them: ``first_duplicate_key`` finds, in the object the standard library would
  finish first, the key it would have refused.

One answer differs: a body nested past what the standard library's recursive
parser can hold (which depends on the caller's stack, not on the document alone)
is refused with ``NestingError``, where ``json.loads`` raises ``RecursionError``.
"""

from __future__ import annotations

import json
import re
from typing import Any

import orjson

# What the duplicate scan stops at outside strings: a string's opening quote, an
# object's braces. Arrays, numbers and literals hold no keys.
_TOKEN = re.compile(rb'["{}]')
_COLON = re.compile(rb"[ \t\n\r]*:")
# The rest of a string that has escapes, through its closing quote.
_ESCAPED_REST = re.compile(rb'(?:[^"\\]+|\\.)*"', re.DOTALL)
MAX_DEPTH = 1024  # orjson's nesting limit; deeper, the standard library's parser runs
_HUGE = float(2**63)  # orjson's integers reach -2**63 .. 2**64 - 1; past them, floats


class DuplicateKeyError(ValueError):
    """A JSON object names ``key`` more than once."""

    def __init__(self, key: str):
        super().__init__(f"JSON object has the key {key!r} more than once")
        self.key = key


class NestingError(ValueError):
    """A JSON document nests arrays and objects deeper than the parsers read."""

    def __init__(self):
        super().__init__(
            f"JSON nests arrays or objects too deeply (more than {MAX_DEPTH} levels, or past "
            "what the parser can hold)"
        )


def loads(body: bytes) -> Any:
    """The JSON document of ``body`` (UTF-8, or any encoding ``json.loads`` detects).

    Raises ``json.JSONDecodeError`` or ``UnicodeDecodeError`` as ``json.loads`` does,
    ``DuplicateKeyError`` for a repeated key in any object and ``NestingError`` for a
    document nested too deeply to parse.

    >>> loads(b'{"a": [1, {"b": "x"}]}')
    {'a': [1, {'b': 'x'}]}
    >>> loads(b'{"a": 1, "\\\\u0061": 2}')
    Traceback (most recent call last):
    ...
    deployments.request_json.DuplicateKeyError: JSON object has the key 'a' more than once
    """
    try:
        document = orjson.loads(body)
        exact = not _has_huge_float(document)
    except orjson.JSONDecodeError:
        exact = False
    if not exact:
        try:
            return json.loads(body, object_pairs_hook=_no_duplicates)
        except RecursionError:  # the C scanner recurses per level and unwinds cleanly
            raise NestingError() from None
    key = first_duplicate_key(body)
    if key is not None:
        raise DuplicateKeyError(key)
    return document


def _has_huge_float(document: Any) -> bool:
    """Whether a float of magnitude 2**63 or more (what orjson makes of an integer it
    cannot hold in 64 bits) is anywhere in ``document``."""
    stack = [document]
    while stack:
        value = stack.pop()
        if isinstance(value, float):
            if abs(value) >= _HUGE:
                return True
        elif isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return False


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKeyError(key)
        out[key] = value
    return out


def first_duplicate_key(body: bytes) -> str | None:
    """The repeated key ``json.loads``'s pairs hook meets first in valid UTF-8 JSON: the
    first repeat within the first object to close (the hook runs as each object closes),
    or None.

    Scans from quote to quote and brace to brace with ``re``/``bytes.find``, so a long
    string costs two C-level searches, not a Python step per character.

    >>> first_duplicate_key(b'{"a": 1, "a": {"b": 2, "b": 3}}')
    'b'
    >>> first_duplicate_key(b'[{"a": "a"}, {"a": ":"}]') is None
    True
    """
    objects: list[tuple[set[str], list[str]]] = []  # per open object: keys, repeats
    pos = 0
    while match := _TOKEN.search(body, pos):
        start = match.start()
        char = body[start]
        if char == 0x7B:  # {
            objects.append((set(), []))
            pos = start + 1
        elif char == 0x7D:  # }
            _, repeats = objects.pop()
            if repeats:
                return repeats[0]
            pos = start + 1
        else:
            end = _string_end(body, start + 1)
            pos = end + 1
            if _COLON.match(body, pos):  # only a key is followed by a colon
                keys, repeats = objects[-1]
                key = _key(body[start:pos])
                if key in keys:
                    repeats.append(key)
                keys.add(key)
    return None


def _string_end(body: bytes, first: int) -> int:
    """The index of the closing quote of the string whose contents start at ``first``."""
    end = body.index(b'"', first)
    if body.find(b"\\", first, end) < 0:
        return end
    match = _ESCAPED_REST.match(body, first)
    assert match is not None, "unterminated string in a body orjson accepted"
    return match.end() - 1


def _key(token: bytes) -> str:
    """A key's text from its quoted token: escapes decoded, so ``"a"`` and ``"\\u0061"``
    are the same key."""
    if b"\\" in token:
        return json.loads(token)
    return token[1:-1].decode()
