"""Admission at the ingress: read the body, decode its envelope, gate modality, split,
plan, limit.

Ray-free: everything that can refuse a request runs in this module, so a bad
request never reaches a rank. Pixels are never decoded here; images are planned
from their headers alone.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.requests import Request

from kimi_encoder import b64
from kimi_encoder.config import PreprocessConfig, VisionConfig
from kimi_encoder.engines.vllm import check_uuid
from kimi_encoder.features import FEATURE_DTYPES, PIXEL_DTYPE, STORAGE
from kimi_encoder.items import (
    BACKENDS,
    EncoderInputError,
    EncoderItem,
    LimitExceededError,
    check_grid_rows,
    check_modality,
    plan_image,
    split_pixel_values,
    unsupported_backend,
)

from . import request_json
from .args import BodyPace, ModelArgs, RequestLimits
from .schemas import EncodeRequest, ImageItem, ResponseFormat, VllmEcOutput
from .vllm_push import VllmPushOutput, check_push_output

FORM_FIELDS = ("image", "response_format", "backend", "feature_dtype")


class UnsupportedMediaTypeError(EncoderInputError):
    """A body that is neither JSON nor multipart (HTTP 415)."""

    def __init__(self, content_type: str):
        super().__init__(
            f"Content-Type {content_type!r} is not supported; send application/json "
            "(EncodeRequest) or multipart/form-data with 'image' files."
        )


class MalformedBodyError(EncoderInputError):
    """A body that is not well-formed JSON or multipart (HTTP 422)."""


class FormError(MalformedBodyError):
    """A malformed multipart body (HTTP 422)."""


class BodyTimeoutError(EncoderInputError):
    """The request body came too slowly (HTTP 408)."""


class BodyLostError(RuntimeError):
    """A declared body that did not reach this replica whole, which says nothing about the
    client (HTTP 503): not one byte of it by the deadline, or it ended short of its
    Content-Length. Serve's proxy hands a body to a replica once: when the replica that
    read it dies before it has taken the request, the proxy gives the request to another
    replica without it. A proxy saturated by answers holds bodies back too."""

    retry_after_s = 1


class IngressBusyError(RuntimeError):
    """This ingress replica reads as many bodies as it may at once (HTTP 503)."""

    retry_after_s = 1

    def __init__(self, limit: int):
        super().__init__(
            f"this ingress replica is reading max_concurrent_bodies={limit} request bodies "
            f"already; retry after {self.retry_after_s} s."
        )


class BodySlots:
    """At most ``limit`` bodies read at once; one more is refused at once, never queued."""

    def __init__(self, limit: int):
        self.limit = limit
        self.reading = 0

    @contextmanager
    def take(self) -> Iterator[None]:
        if self.reading >= self.limit:
            raise IngressBusyError(self.limit)
        self.reading += 1
        try:
            yield
        finally:
            self.reading -= 1


class OutputNotConfiguredError(EncoderInputError):
    """A request asks for an output this server is not configured to write (HTTP 400)."""


@dataclass
class Admitted:
    """Items ready for dispatch (one grid each), the request item each came from, and how
    the answer is written."""

    items: list[EncoderItem]
    sources: list[int]
    feature_dtype: str
    response_format: ResponseFormat = "json"
    output: VllmEcOutput | VllmPushOutput | None = None  # None: the features are the answer

    @property
    def patches(self) -> int:
        return sum(item.num_patches for item in self.items)


@dataclass(frozen=True)
class Admission:
    """What admission needs: the checkpoint's configs, the request limits, the body pace,
    the model as the ranks run it (the defaults of a request: backend, feature dtype; the
    model's dtype) and whether output kind 'vllm_ec' has a directory to go to."""

    vision: VisionConfig
    preprocess: PreprocessConfig
    limits: RequestLimits
    pace: BodyPace
    model: ModelArgs
    vllm_ec: bool = False

    async def admit(self, request: Request) -> Admitted:
        """A ``POST /v1/encode`` body: JSON (``EncodeRequest``) or multipart ``image`` files."""
        length = declared_length(request)
        if length is not None:
            self.check_body_size(length)
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if kind not in ("application/json", "", "multipart/form-data"):
            raise UnsupportedMediaTypeError(kind)
        # Read (at most max_request_bytes, at the body pace) first, then parse from memory:
        # a chunked upload without a Content-Length can neither fill the memory nor the
        # temp-file disk, and a trickling one cannot hold its slot for long.
        limit = self.limits.max_request_bytes
        body = await read_body(request.stream(), limit, self.pace, length)
        if kind == "multipart/form-data":
            return await self._admit_form(Request(request.scope, replay(body)))
        return self.admit_json(EncodeRequest.model_validate(parse_json(body)))

    async def _admit_form(self, request: Request) -> Admitted:
        limit = self.limits.max_images_per_request + 1
        try:
            form = await request.form(max_files=limit, max_fields=limit + 8)
        except HTTPException as exc:  # starlette's MultiPartException, as a 400
            raise _multipart_error(str(exc.detail), self.limits.max_images_per_request) from None
        try:
            unknown = sorted(set(form.keys()) - set(FORM_FIELDS))
            if unknown:
                raise FormError(f"unknown form fields {unknown}; allowed: {sorted(FORM_FIELDS)}.")
            uploads = form.getlist("image")
            if not uploads or not all(isinstance(u, UploadFile) for u in uploads):
                raise FormError(
                    "send one or more files in the 'image' field "
                    "(curl -F image=@a.png -F image=@b.jpg)."
                )
            files = [await u.read() for u in uploads]
            fmt, backend, dtype = (form.get(k) or None for k in FORM_FIELDS[1:])
        finally:
            await form.close()
        if fmt not in (None, "json", "safetensors"):
            raise FormError(f"response_format {fmt!r} is not one of 'json', 'safetensors'.")
        if dtype not in (None, *FEATURE_DTYPES):
            raise FormError(
                f"feature_dtype {dtype!r} is not one of {', '.join(map(repr, FEATURE_DTYPES))}."
            )
        self.check_body_size(sum(len(f) for f in files))
        admitted = self.admit_files(files, backend, dtype)
        admitted.response_format = fmt or "json"
        return admitted

    def backend(self, requested: str | None) -> str:
        """The request's backend: its own choice ('gpu'/'cpu') or the configured default."""
        if requested is None:
            return self.model.preprocess_backend
        if requested not in BACKENDS:
            raise EncoderInputError(str(unsupported_backend(requested)))
        return requested

    def check_body_size(self, size: int) -> None:
        if size > self.limits.max_request_bytes:
            raise LimitExceededError(
                f"request body is {size} bytes, over max_request_bytes="
                f"{self.limits.max_request_bytes}; send fewer or smaller images per request."
            )

    def admit_json(self, request: EncodeRequest) -> Admitted:
        """Modality gate, base64 decode, split of aggregated items, header-only planning."""
        backend = self.backend(request.backend)
        items: list[EncoderItem] = []
        sources: list[int] = []
        for index, entry in enumerate(request.items):
            check_modality(entry.type, index)
            assert isinstance(entry, ImageItem), type(entry)
            if entry.image is not None:
                new = [self._plan(_decode_image_field(entry.image, index), backend, index)]
            else:
                new = self._split(entry, index)
            items += new
            sources += [index] * len(new)
            self._check_count(len(items))
        dtype = request.feature_dtype or self.model.feature_dtype
        if request.output is not None:
            self._check_ec_output(request, len(items))
            dtype = self.model.dtype
        admitted = Admitted(items, sources, dtype, request.response_format, request.output)
        return self._checked(admitted)

    def _check_ec_output(self, request: EncodeRequest, count: int) -> None:
        """An output of kind 'vllm_ec': configured, one valid, distinct uuid per item,
        JSON metadata in the model's dtype."""
        assert request.output is not None
        kind = request.output.kind
        if kind == "vllm_push":
            check_push_output(request.output)
        elif not self.vllm_ec:
            raise OutputNotConfiguredError(
                "output kind 'vllm_ec' needs an encoder-cache directory and this server has "
                "none; set the app's args handoff.ec_root to the vLLM consumer's "
                "shared_storage_path (an absolute directory the ingress can write) and redeploy."
            )
        uuids = request.output.uuids
        if len(uuids) != count:
            raise EncoderInputError(
                f"output.uuids has {len(uuids)} entries for {count} images (after splitting "
                "aggregated items); send one uuid per image, in order."
            )
        if request.response_format != "json":
            raise EncoderInputError(
                f"output kind {kind!r} answers JSON metadata, not {request.response_format!r}; "
                "drop response_format."
            )
        if request.feature_dtype not in (None, self.model.dtype):
            raise EncoderInputError(
                f"output kind {kind!r} stores the model's dtype ({self.model.dtype}), not "
                f"{request.feature_dtype!r}; drop feature_dtype."
            )
        first: dict[str, int] = {}
        for index, uuid in enumerate(uuids):
            try:
                check_uuid(uuid)
            except ValueError as exc:
                raise EncoderInputError(f"output.uuids[{index}]: {exc}") from None
            if uuid in first:
                raise EncoderInputError(
                    f"output.uuids[{index}] {uuid!r} repeats output.uuids[{first[uuid]}]; "
                    "each uuid names one cache entry: send distinct uuids."
                )
            first[uuid] = index

    def admit_files(
        self,
        files: list[bytes],
        backend: str | None,
        feature_dtype: str | None = None,
        digests: Sequence[bytes | None] | None = None,
    ) -> Admitted:
        """Multipart upload: each file is one image. ``digests``, where given, are the
        files' SHA-256 as the caller already computed them (an item's key reuses it)."""
        chosen = self.backend(backend)
        self._check_count(len(files))
        items = [self._plan(data, chosen, index) for index, data in enumerate(files)]
        if digests is not None:
            for item, digest in zip(items, digests, strict=True):
                item.image_sha256 = digest
        dtype = feature_dtype or self.model.feature_dtype
        return self._checked(Admitted(items, list(range(len(items))), dtype))

    def _plan(self, data: bytes, backend: str, index: int) -> EncoderItem:
        return plan_image(
            data, self.preprocess, backend, max_pixels=self.limits.max_image_pixels, index=index
        )

    def _split(self, entry: ImageItem, index: int) -> list[EncoderItem]:
        assert entry.pixel_values is not None
        assert entry.grid_thws is not None
        pixels = _decode_pixel_values(entry, self.vision.patch_size, index)
        grids = check_grid_rows(entry.grid_thws, self.vision.merge_kernel_size, index)
        split = split_pixel_values(pixels, grids, index)
        for item in split:  # own storage each: a view would ship the whole array to every rank
            item.pixel_values = item.pixel_values.clone()
        return split

    def _check_count(self, count: int) -> None:
        if count > self.limits.max_images_per_request:
            raise LimitExceededError(
                f"request has more than max_images_per_request="
                f"{self.limits.max_images_per_request} images (after splitting aggregated "
                "items); split it into several requests."
            )

    def _checked(self, admitted: Admitted) -> Admitted:
        if admitted.patches > self.limits.max_patches_per_request:
            raise LimitExceededError(
                f"request needs {admitted.patches} patches, over max_patches_per_request="
                f"{self.limits.max_patches_per_request}; send fewer or smaller images."
            )
        return admitted


def _b64(text: str, what: str, index: int) -> bytes:
    try:
        return b64.decode(text)
    except ValueError as exc:  # binascii.Error included
        raise EncoderInputError(
            f"{what} is not valid base64 ({exc}); send standard base64 (A-Z a-z 0-9 + /, "
            "padded with =) without line breaks.",
            index,
        ) from None


def _decode_image_field(text: str, index: int) -> bytes:
    """Bytes of an ``image`` field: plain base64 or ``data:<mime>;base64,<payload>``."""
    if text.startswith("data:"):
        header, sep, payload = text.partition(",")
        if not sep or not header.endswith(";base64"):
            raise EncoderInputError(
                f"'image' data URL header {header[:60]!r} is not base64-encoded; use "
                "'data:image/png;base64,<payload>'.",
                index,
            )
        media_type = header[len("data:") :].split(";")[0].strip().lower()
        if not media_type.startswith("image/"):
            raise EncoderInputError(
                f"'image' data URL has media type {media_type[:60] or '(none)'!r}; allowed "
                "media types are image/* (e.g. 'data:image/png;base64,<payload>').",
                index,
            )
        text = payload
    return _b64(text, "'image'", index)


def _decode_pixel_values(entry: ImageItem, patch: int, index: int) -> torch.Tensor:
    values = entry.pixel_values
    assert values is not None
    shape = list(values.shape)
    if shape[1:] != [3, patch, patch] or shape[0] < 1:
        raise EncoderInputError(
            f"pixel_values.shape is {shape}; expected [rows, 3, {patch}, {patch}] with rows >= 1.",
            index,
        )
    raw = _b64(values.data, "'pixel_values.data'", index)
    storage = STORAGE[PIXEL_DTYPE]
    need = int(np.prod(shape)) * storage.itemsize
    if len(raw) != need:
        raise EncoderInputError(
            f"pixel_values.data has {len(raw)} bytes but shape {shape} of {PIXEL_DTYPE} needs "
            f"{need}; send the array's little-endian bytes in C order.",
            index,
        )
    array = np.frombuffer(raw, dtype=storage).reshape(shape)
    bad = int(array.size - np.count_nonzero(np.isfinite(array)))
    if bad:
        raise EncoderInputError(
            f"pixel_values has {bad} non-finite values (NaN or inf) of {array.size}; send "
            "finite normalized pixels.",
            index,
        )
    return torch.from_numpy(array.astype(np.float32))  # writable, native-endian copy


def declared_length(request: Request) -> int | None:
    """The request's Content-Length, None without one (a chunked upload) or if malformed."""
    length = request.headers.get("content-length")
    return int(length) if length is not None and length.isdigit() else None


async def read_body(
    chunks: AsyncIterator[bytes],
    limit: int,
    pace: BodyPace | None = None,
    declared: int | None = None,
) -> bytes:
    """The whole request body, refused (413) as soon as it passes ``limit`` bytes, and
    (408) as soon as it falls behind ``pace``. A body of ``declared`` bytes (its
    Content-Length) of which not one byte has come by the deadline, or that ends short,
    was held up or lost between the client and this replica (``BodyLostError``, 503).

    Covers bodies without a Content-Length (chunked uploads): the ingress never
    buffers more than ``limit`` bytes of one request.
    """
    pace = pace or BodyPace()
    parts: list[bytes] = []
    size = 0
    started = time.monotonic()
    stream = aiter(chunks)
    while True:
        wait = started + pace.deadline(size) - time.monotonic()
        try:
            chunk = await asyncio.wait_for(anext(stream), max(wait, 0.0))
        except StopAsyncIteration:
            break
        except asyncio.TimeoutError:
            if size == 0 and declared:
                raise BodyLostError(
                    f"not one byte of the request's {declared}-byte body reached this ingress "
                    f"replica within {time.monotonic() - started:.1f} s: it was held up on its "
                    "way (a saturated proxy) or lost there (an ingress replica that failed "
                    "before it took the request). Send it again."
                ) from None
            raise BodyTimeoutError(
                f"request body too slow: {size} bytes in {time.monotonic() - started:.1f} s; "
                f"a body must arrive within {pace.timeout_s:g} s and, after "
                f"{pace.grace_s:g} s, at {pace.min_bytes_per_s:g} bytes/s or more. Send it "
                "at once, or in smaller requests."
            ) from None
        size += len(chunk)
        if size > limit:
            raise LimitExceededError(
                f"request body is over max_request_bytes={limit} ({size} bytes received "
                "when it was refused); send fewer or smaller images per request."
            )
        parts.append(chunk)
    if declared is not None and size < declared:
        raise BodyLostError(
            f"the request body ended after {size} of its {declared} bytes (Content-Length): "
            "the rest was lost on its way (an ingress replica that failed before it took the "
            "request) or the client went away. Send it again."
        )
    return b"".join(parts)


def parse_json(body: bytes) -> Any:
    """The JSON document of ``body``; refuses invalid JSON and duplicate keys (422)."""
    try:
        return request_json.loads(body)
    except request_json.DuplicateKeyError as exc:
        raise MalformedBodyError(
            f"JSON object has the key {exc.key!r} more than once; send each key once."
        ) from None
    except request_json.NestingError as exc:
        raise MalformedBodyError(
            f"body is not an EncodeRequest: {exc}; an EncodeRequest nests a few levels."
        ) from None
    except json.JSONDecodeError as exc:
        raise MalformedBodyError(
            f"body is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}); "
            "send an EncodeRequest object (see /docs)."
        ) from None
    except UnicodeDecodeError:
        raise MalformedBodyError("body is not UTF-8 JSON; send an EncodeRequest object.") from None


def _multipart_error(detail: str, max_images: int) -> EncoderInputError:
    """Starlette's multipart parser errors as ours: limits are 413, the rest 422."""
    if detail.startswith("Too many files"):
        return LimitExceededError(
            f"multipart body has more than max_images_per_request={max_images} files; split "
            "it into several requests."
        )
    if detail.startswith(("Too many fields", "Part exceeded", "Field exceeded")):
        return LimitExceededError(
            f"multipart body over a form limit ({detail}); send only the 'image' files and the "
            f"fields {list(FORM_FIELDS[1:])}."
        )
    return FormError(
        f"malformed multipart body ({detail}); send multipart/form-data with "
        "a boundary and 'image' files (curl -F image=@a.png)."
    )


def replay(body: bytes) -> Callable[[], Awaitable[dict]]:
    """An ASGI ``receive`` that hands over an already read request body."""

    async def receive() -> dict:
        return {"type": "http.request", "body": body, "more_body": False}

    return receive
