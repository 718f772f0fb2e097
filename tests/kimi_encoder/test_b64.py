"""``kimi_encoder.b64`` against the standard library: same bytes, same acceptance."""

from __future__ import annotations

import base64
import binascii
import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kimi_encoder import b64


def reference(text: str | bytes) -> bytes | ValueError:
    try:
        return base64.b64decode(text, validate=True)
    except ValueError as exc:
        return exc


@given(st.binary(max_size=300))
def test_round_trip_equals_the_standard_library(data: bytes):
    encoded = b64.encode(data)
    assert encoded == base64.b64encode(data)
    assert b64.decode(encoded) == data
    assert b64.decode(encoded.decode()) == data


# Valid base64 with stray padding, whitespace, URL-safe letters and non-ASCII mixed in.
@given(st.text(alphabet="QWERTYabcxyz019+/=-_ \n\té", max_size=40))
def test_accepts_exactly_what_the_standard_library_accepts(text: str):
    expected = reference(text)
    if isinstance(expected, ValueError):  # refused with the standard library's reason
        with pytest.raises(type(expected), match=re.escape(str(expected))):
            b64.decode(text)
    else:
        assert b64.decode(text) == expected


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("YW Jj", "Only base64 data is allowed"),
        ("YWJ", "Incorrect padding"),
        ("=YWJj", "Leading padding not allowed"),
        ("YWJjZA==YQ==", "Excess data after padding"),
        ("é", "only ASCII"),
    ],
    ids=["space", "short", "leading-pad", "after-padding", "non-ascii"],
)
def test_a_refusal_names_what_is_wrong(text: str, reason: str):
    with pytest.raises(ValueError, match=reason):
        b64.decode(text)


def test_extra_padding_is_accepted_as_the_standard_library_does():
    assert b64.decode("YWJj=") == b"abc"


def test_encode_reads_an_array_buffer_in_place():
    array = np.arange(12, dtype="<f4")
    assert b64.encode(memoryview(array).cast("B")) == base64.b64encode(array.tobytes())
    with pytest.raises(binascii.Error):
        b64.decode("@@@@")
