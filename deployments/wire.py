"""Response bodies built from the ranks' feature arrays with one copy of the payload.

The ranks return each item's features as an array of its own in the feature dtype
(bfloat16 as raw 16-bit words, ``kimi_encoder.features``), all of a call's in one
object-store object; on the ingress each is a read-only view of that object. A
body is then written once, never upcast:

- JSON: the envelope (everything but the feature data) is dumped with
  ``json.dumps`` as usual, with a marker where each ``data`` string goes; the
  markers are replaced by the base64 of each array, encoded straight from its
  buffer, and the pieces joined once. The straightforward path copies each
  array to ``bytes``, encodes, decodes to ``str``, dumps the whole document to a
  ``str`` and encodes that to UTF-8: four more full copies.
- safetensors: header, then each array's buffer (``memoryview``) joined once;
  ``safetensors.numpy.save`` first copies every array to ``bytes`` and then
  copies them all again into its output (and has no bfloat16).

Not streamed: Serve 2.60 pickles every ASGI message to its proxy, which takes
``bytes``, so chunks of the arrays cost the same copy as the join; served answers
sent in chunks moved no more bytes per second.

Always ``bytes``, behind HAProxy too. Written into one numpy buffer and handed to
the socket as a view, a body skips one copy where the replica writes its own
socket, faster alone. It cannot go everywhere: HAProxy's backup server is Serve's
proxy, which pickles the answer and cannot pickle a view, so the path must be told
per request (only by the type of Serve's private ASGI ``receive``); served behind
HAProxy, the ingress replica's CPU per request did not move beyond the noise. The
figures of both are in docs/api.md, "Measurements behind the code".

``benchmarks/bench_wire.py`` measures both paths (time per MB, bytes allocated
per payload byte).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from starlette.responses import JSONResponse, Response

from kimi_encoder import b64
from kimi_encoder.features import SAFETENSORS, safetensors_body
from kimi_encoder.items import EncoderItem

from .admission import Admitted
from .fanout import Gathered
from .schemas import ItemFeatures, Usage


def array_base64(array: np.ndarray) -> bytes:
    """Base64 (ASCII bytes) of an array's little-endian bytes, read from its buffer in place
    (a non-contiguous array is copied once)."""
    data = np.ascontiguousarray(array)
    assert data.dtype.byteorder != ">", data.dtype
    return b64.encode(data.reshape(-1).view(np.uint8))


def json_body(payload: Mapping[str, Any]) -> bytes:
    """UTF-8 JSON of ``payload``, where any ``items[i]["data"]`` that is an array becomes base64."""
    marker = f"@@data-{secrets.token_hex(8)}-"
    items = payload.get("items", [])
    arrays: list[np.ndarray] = []
    envelope_items = []
    for item in items:
        data = item.get("data")
        if isinstance(data, np.ndarray):
            item = {**item, "data": f"{marker}{len(arrays)}@@"}
            arrays.append(data)
        envelope_items.append(item)
    text = json.dumps({**payload, "items": envelope_items}, separators=(",", ":"))
    if not arrays:
        return text.encode()
    parts: list[bytes] = []
    rest = text
    for i, array in enumerate(arrays):
        before, found, rest = rest.partition(f"{marker}{i}@@")
        assert found, f"marker {i} missing from the JSON envelope"
        parts += [before.encode(), array_base64(array)]
    parts.append(rest.encode())
    return b"".join(parts)


class FeaturesJSONResponse(JSONResponse):
    """``JSONResponse`` whose items may carry numpy arrays as ``data`` (see ``json_body``)."""

    def render(self, content: Any) -> bytes:
        return json_body(content)


def safetensors_response(model: str, admitted: Admitted, gathered: Gathered) -> Response:
    """``features.{i}`` in the feature dtype and ``grid_thw.{i}`` int64 ``[1, 3]`` per item."""
    dtype = SAFETENSORS[gathered.dtype]
    tensors: dict[str, tuple[np.ndarray, str]] = {}
    for i, (item, array) in enumerate(zip(admitted.items, gathered.features, strict=True)):
        tensors[f"features.{i}"] = (array, dtype)
        tensors[f"grid_thw.{i}"] = (np.asarray([item.grid], dtype=np.int64), "I64")
    meta = {"model": model, "owner_ranks": json.dumps(gathered.owners)}
    body = safetensors_body(tensors, metadata=meta)
    return Response(body, media_type="application/octet-stream")


def json_response(
    model: str, admitted: Admitted, gathered: Gathered, timings: Callable[[], dict[str, float]]
) -> FeaturesJSONResponse:
    """The JSON answer (``schemas.EncodeResponse``); ``timings()`` is called last, so its
    ``gather`` and ``total`` include writing the envelope."""
    items = []
    for i, (item, array, owner) in enumerate(
        zip(admitted.items, gathered.features, gathered.owners, strict=True)
    ):
        entry = ItemFeatures(
            index=i,
            grid_thw=list(item.grid),
            num_tokens=array.shape[0],
            owner_rank=owner,
            original_size=list(item.original_size) if item.original_size else None,
            resized_size=_resized_size(item),
            shape=list(array.shape),
            dtype=gathered.dtype,
            data="",
        ).model_dump()
        items.append(entry | {"data": array})  # base64 written straight into the body
    tokens = sum(a.shape[0] for a in gathered.features)
    usage = Usage(images=len(items), patches=admitted.patches, tokens=tokens)
    payload = {"model": model, "items": items, "usage": usage.model_dump()}
    return FeaturesJSONResponse(payload | {"timings_ms": timings()})


def _resized_size(item: EncoderItem) -> list[int] | None:
    if item.deferred is None:
        return None
    resize = item.deferred.resize_config
    return [resize.new_width, resize.new_height]
