"""Base64 for image uploads and JSON features, with SIMD (``pybase64``).

Base64 is on every JSON request (each image) and every JSON answer (each
item's features: megabytes per image at Kimi-K3's width), where ``pybase64``
(SIMD) is faster than the standard library both ways, decoding most
(docs/api.md, "Measurements behind the code").

``decode`` accepts exactly what ``base64.b64decode(text, validate=True)``
accepts and returns the same bytes: the fast decoder is stricter about excess
padding, so anything it refuses is decoded again by the standard library,
which either accepts it or raises with its precise reason.
"""

from __future__ import annotations

import base64

import pybase64


def decode(text: str | bytes) -> bytes:
    """Bytes of standard base64 (``A-Z a-z 0-9 + /``, ``=`` padding, no whitespace).

    Raises ``binascii.Error`` (a ``ValueError``) for anything else, naming what is wrong.

    >>> decode("aGk=")
    b'hi'
    """
    try:
        return pybase64.b64decode(text, validate=True)
    except ValueError:  # binascii.Error included; the reference decides and says why
        return base64.b64decode(text, validate=True)


def encode(data: bytes | bytearray | memoryview) -> bytes:
    """Standard base64 (ASCII bytes, padded, no newlines) of a contiguous buffer, read in place.

    >>> encode(b"hi")
    b'aGk='
    """
    return pybase64.b64encode(data)
