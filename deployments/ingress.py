"""``EncodeServer``: the HTTP ingress (FastAPI). Admits, assigns owners, fans out, gathers."""

# No `from __future__ import annotations`: Serve's class-based FastAPI view re-signs the
# route methods and needs real annotation objects (a string `Request` became a query field).

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse, Response
from pydantic import ValidationError
from ray import serve
from ray.exceptions import RayTaskError
from ray.serve.handle import DeploymentHandle
from starlette.datastructures import UploadFile

from kimi_encoder.config import resolve_configs
from kimi_encoder.items import EncoderInputError, LimitExceededError

from .admission import Admission, Admitted, read_body, replay
from .args import AppArgs
from .deadline import RequestTimeoutError, settle_within
from .dispatch import Dispatcher
from .failover import NoRankAvailableError, RankHealth, unavailable
from .metrics import IngressMetrics, RequestTrace, Stamped, current_trace, dispatch_loads
from .schemas import (
    EncodeRequest,
    EncodeResponse,
    ErrorResponse,
    InfoResponse,
    ItemFeatures,
    Usage,
)
from .security import ApiKey
from .wire import FeaturesJSONResponse, safetensors_body

log = logging.getLogger("ray.serve")

api = FastAPI(
    title="Kimi-K3 vision encoder",
    version="0.1.0",
    description="Disaggregated image encoder with vision data parallelism: each image is "
    "encoded by one owner rank, chosen by patch count; features come back in request order.",
)

_ERRORS = {
    400: {"model": ErrorResponse, "description": "Invalid item, backend or data."},
    401: {"model": ErrorResponse, "description": "Missing or wrong API key."},
    413: {"model": ErrorResponse, "description": "Over a configured request limit."},
    415: {"model": ErrorResponse, "description": "Body is neither JSON nor multipart."},
    422: {"model": ErrorResponse, "description": "Malformed body."},
    500: {"model": ErrorResponse, "description": "Encoder failure."},
    503: {"model": ErrorResponse, "description": "A rank is unavailable or busy: retry."},
    504: {"model": ErrorResponse, "description": "Over request_timeout_s."},
}
_MULTIPART_SCHEMA = {
    "type": "object",
    "required": ["image"],
    "properties": {
        "image": {
            "type": "array",
            "items": {"type": "string", "format": "binary"},
            "description": "One or more image files (repeat the field).",
        },
        "response_format": {"type": "string", "enum": ["json", "safetensors"], "default": "json"},
        "backend": {"type": "string", "enum": ["gpu", "cpu"]},
    },
}
_SAFETENSORS_DOC = (
    "safetensors file: features.{i} float32, grid_thw.{i} int64 [1, 3]; "
    "metadata 'owner_ranks' (JSON list) and 'model'."
)
_FORM_FIELDS = {"image", "response_format", "backend"}


def error_response(
    status: int, kind: str, message: str, headers: dict[str, str] | None = None
) -> JSONResponse:
    body = {"error": {"type": kind, "message": message}}
    return JSONResponse(body, status_code=status, headers=headers)


def _field_path(loc: tuple) -> list:
    """``loc`` without 'body' and the item-kind tag after an item index.

    ``body.items.1.image.image`` -> ``items.1.image`` (the tag comes from ``schemas.Item``).
    """
    path = [p for p in loc if p != "body"]
    return [
        p
        for i, p in enumerate(path)
        if not (i and isinstance(path[i - 1], int) and p in ("image", "other"))
    ]


def _validation_message(exc: ValidationError | RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in _field_path(err.get("loc", ())))
        parts.append(f"{loc or 'body'}: {str(err.get('msg')).rstrip('.')}")
    return "; ".join(parts) + ". See /docs for the request schema."


@api.exception_handler(RequestValidationError)
async def _on_request_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
    return error_response(422, "validation_error", _validation_message(exc))


class _UnsupportedMedia(EncoderInputError):
    def __init__(self, kind: str):
        super().__init__(
            f"Content-Type {kind!r} is not supported; send application/json (EncodeRequest) "
            "or multipart/form-data with 'image' files."
        )


class _FormError(EncoderInputError):
    """A malformed multipart body (HTTP 422)."""


def _form_error(message: str) -> _FormError:
    return _FormError(message + ".")


def _resized_size(item: Any) -> list[int] | None:
    if item.deferred is None:
        return None
    resize = item.deferred.resize_config
    return [resize.new_width, resize.new_height]


def _input_error(exc: EncoderInputError) -> JSONResponse:
    if isinstance(exc, LimitExceededError):
        return error_response(413, "limit_exceeded", str(exc))
    if isinstance(exc, _UnsupportedMedia):
        return error_response(415, "unsupported_media_type", str(exc))
    if isinstance(exc, _FormError):
        return error_response(422, "validation_error", str(exc))
    return error_response(400, "invalid_request", str(exc))


def _with_request_schemas(app: FastAPI) -> None:
    """Make ``app.openapi()`` add the request models that the raw-Request route reads by hand.

    A closure over ``app`` (not the module global), so the copy that serve.ingress
    freezes documents its own routes.
    """

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title, version=app.version, description=app.description, routes=app.routes
            )
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            request = EncodeRequest.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(request.pop("$defs", {}))
            components["EncodeRequest"] = request
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


_with_request_schemas(api)


class _Attempt:
    """What one dispatch round got: ``done`` {index: (features, owner, rank ms)}, ``pending``."""

    def __init__(self):
        self.done: dict[int, tuple[np.ndarray, int, float]] = {}
        self.pending: list[int] = []


# The class comes last: serve.ingress freezes (cloudpickles) the FastAPI app and its
# routes when it decorates, so every helper and the openapi override must exist by then.
@serve.ingress(api)
class EncodeServer:
    """Ingress: admission and owner assignment here, encoding on the owner ranks."""

    def __init__(self, ranks: list[DeploymentHandle], args: AppArgs):
        assert len(ranks) == args.dp_size, (len(ranks), args.dp_size)
        self.ranks = ranks
        self.args = args
        vision, preprocess, self.model_name = resolve_configs(args.checkpoint)
        self.admission = Admission(vision, preprocess, args)
        self.api_key = ApiKey.load(args.api_key_file)
        self.vision = vision
        self.dispatcher = Dispatcher(
            args.dp_size,
            model_name=self.model_name,
            dtype=args.dtype,
            cost_model=args.cost_model,
            report_interval_ms=args.load_report_interval_ms,
            affinity_tolerance=args.cache_affinity_tolerance,
            cache_enabled=args.feature_cache_bytes > 0,
        )
        self.health = RankHealth(ranks, args.rank_cooldown_s)
        self.metrics = IngressMetrics(args.dp_size)
        self.page = (Path(__file__).parent / "static" / "index.html").read_text()

    @api.post(
        "/v1/encode",
        response_model=EncodeResponse,
        summary="Encode images into LLM-space features",
        responses={
            200: {
                "content": {
                    "application/octet-stream": {
                        "schema": {
                            "type": "string",
                            "format": "binary",
                            "description": _SAFETENSORS_DOC,
                        }
                    }
                }
            },
            **_ERRORS,
        },
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {"schema": {"$ref": "#/components/schemas/EncodeRequest"}},
                    "multipart/form-data": {"schema": _MULTIPART_SCHEMA},
                },
            }
        },
    )
    async def encode(self, request: Request) -> Response:
        """JSON (``EncodeRequest``) or multipart upload (``image`` files); see docs/api.md."""
        # Serve's proxy sets X-Request-ID (the client's, else a new one), returns it in the
        # response and carries it to the ranks' log records.
        with self.metrics.trace(request.headers.get("x-request-id", "")) as trace:
            response = await self._encode(request, trace)
            trace.status = response.status_code
        return response

    async def _encode(self, request: Request, trace: RequestTrace) -> Response:
        started = trace.started
        if (denied := self.api_key.deny(request)) is not None:
            return denied
        try:
            admitted, response_format = await self._admit(request)
        except ValidationError as exc:
            return error_response(422, "validation_error", _validation_message(exc))
        except EncoderInputError as exc:
            return _input_error(exc)
        admitted_at = time.perf_counter()
        trace.admitted(admitted.items, admitted_at)
        try:
            features, owners, rank_ms = await self._fan_out(admitted)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a JSON error
            cause = exc.cause if isinstance(exc, RayTaskError) else exc
            if isinstance(cause, RequestTimeoutError):
                return error_response(504, "timeout", str(cause))
            if isinstance(cause, EncoderInputError):
                return _input_error(cause)
            if isinstance(cause, NoRankAvailableError):
                retry = {"Retry-After": str(cause.retry_after_s)}
                return error_response(503, "unavailable", str(cause), retry)
            log.exception("encode failed")
            return error_response(500, "internal_error", f"{type(cause).__name__}: {cause}")
        done = time.perf_counter()
        timings = {
            "admit": (admitted_at - started) * 1e3,
            "encode": (done - admitted_at) * 1e3,
            **{f"rank_{r}": ms for r, ms in sorted(rank_ms.items())},
            **trace.rank_timings(),
        }
        if response_format == "safetensors":
            body = self._safetensors(admitted, features, owners)
            timings["gather"] = trace.mark("gather", trace.results_at or done)
            timings["total"] = (time.perf_counter() - started) * 1e3
            headers = {"X-Timings-Ms": json.dumps({k: round(v, 3) for k, v in timings.items()})}
            return Response(body, media_type="application/octet-stream", headers=headers)
        payload = self._json(admitted, features, owners, timings, started)
        payload["timings_ms"]["gather"] = round(trace.mark("gather", trace.results_at or done), 3)
        return FeaturesJSONResponse(payload)

    @api.get("/v1/info", response_model=InfoResponse, summary="Model, dims and each rank's state")
    async def info(self, request: Request) -> Any:
        if (denied := self.api_key.deny(request)) is not None:
            return denied
        ranks = await asyncio.gather(*(self._rank_info(r) for r in range(len(self.ranks))))
        return {
            "model": self.model_name,
            **self.vision.summary(),
            "dtype": self.args.dtype,
            "device": self.args.rank_device,
            "preprocess_backend": self.args.default_backend,
            "dp_size": len(self.ranks),
            "assignment": self.dispatcher.info(),
            "failover": self.health.info(),
            "ranks": ranks,
        }

    @api.get("/v1/load", summary="In-flight requests, images, patches and bytes per rank")
    async def load(self, request: Request) -> Any:
        """What this ingress replica has dispatched to each rank and not yet got back."""
        if (denied := self.api_key.deny(request)) is not None:
            return denied
        return {"ranks": self.metrics.load()}

    @api.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def page(self) -> HTMLResponse:
        """A try-it page: drop images, see grids, owners, timings and a PCA of the features."""
        return HTMLResponse(self.page)

    @api.get("/healthz", summary="Liveness of the ingress")
    async def healthz(self) -> dict[str, str]:
        return {"status": "ok"}

    def check_health(self) -> None:
        """Cheap: the ingress holds its rank handles."""
        if not self.ranks:
            raise RuntimeError("ingress has no encoder ranks")

    async def _admit(self, request: Request) -> tuple[Admitted, str]:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit():
            self.admission.check_body_size(int(length))
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if kind == "multipart/form-data":
            return await self._admit_form(request)
        if kind not in ("application/json", ""):
            raise _UnsupportedMedia(kind)
        body = await read_body(request.stream(), self.args.max_request_bytes)
        parsed = EncodeRequest.model_validate_json(body)
        return self.admission.admit_json(parsed), parsed.response_format

    async def _admit_form(self, request: Request) -> tuple[Admitted, str]:
        limit = self.args.max_images_per_request + 1
        # Read (at most max_request_bytes) first, then parse from memory: a chunked upload
        # without a Content-Length can neither fill the memory nor the temp-file disk.
        body = await read_body(request.stream(), self.args.max_request_bytes)
        request = Request(request.scope, replay(body))
        async with request.form(max_files=limit, max_fields=limit + 8) as form:
            unknown = sorted(set(form.keys()) - _FORM_FIELDS)
            if unknown:
                raise _form_error(f"unknown form fields {unknown}; allowed: {sorted(_FORM_FIELDS)}")
            uploads = form.getlist("image")
            if not uploads or not all(isinstance(u, UploadFile) for u in uploads):
                raise _form_error(
                    "send one or more files in the 'image' field "
                    "(curl -F image=@a.png -F image=@b.jpg)"
                )
            files = [await u.read() for u in uploads]
            options = {k: form.get(k) for k in ("response_format", "backend")}
        fmt = options["response_format"] or "json"
        if fmt not in ("json", "safetensors"):
            raise _form_error(f"response_format {fmt!r} is not one of 'json', 'safetensors'")
        self.admission.check_body_size(sum(len(f) for f in files))
        backend = options["backend"] or None
        return self.admission.admit_files(files, backend), str(fmt)

    async def _fan_out(
        self, admitted: Admitted
    ) -> tuple[list[np.ndarray], list[int], dict[int, float]]:
        """Call only the ranks that own something, concurrently; gather in request order.

        A rank that fails with an unavailable error (deployments/failover.py) is marked
        down and its images go to the ranks still up, until all have features or
        request_timeout_s is spent; with no rank up, NoRankAvailableError (503).
        """
        items = admitted.items
        timeout_s = self.args.request_timeout_s
        deadline = time.monotonic() + timeout_s
        features: list[np.ndarray | None] = [None] * len(items)
        owners: list[int] = [-1] * len(items)
        rank_ms: dict[int, float] = {}
        pending = list(range(len(items)))  # request indices still without features
        await self.dispatcher.refresh(self.ranks, skip=self.health.down())
        while pending:
            if len(down := self.health.down()) == len(self.ranks):
                raise NoRankAvailableError(self.health.retry_after_s())
            attempt = await self._dispatch(pending, admitted, down, deadline, timeout_s)
            for i, (array, owner, ms) in attempt.done.items():
                features[i], owners[i] = array, owner
                rank_ms[owner] = ms
            self.health.redispatched += len(attempt.pending)
            pending = attempt.pending
        if (trace := current_trace()) is not None:
            trace.owners = owners
            trace.results_at = time.perf_counter()
        merge, width = self.vision.merge_kernel_size[0], self.vision.text_hidden_size
        for i, (item, array) in enumerate(zip(items, features, strict=True)):
            expected = (item.num_tokens(merge), width)
            if array is None or tuple(array.shape) != expected:
                got = None if array is None else tuple(array.shape)
                raise RuntimeError(
                    f"item {i}: rank {owners[i]} returned {got}, grid needs {expected}"
                )
        return features, owners, rank_ms  # type: ignore[return-value]

    async def _dispatch(
        self,
        pending: list[int],
        admitted: Admitted,
        down: set[int],
        deadline: float,
        timeout_s: float,
    ) -> _Attempt:
        """One round: ``pending`` items to the ranks not ``down``; what came back, what failed."""
        items = [admitted.items[i] for i in pending]
        sources = [admitted.sources[i] for i in pending]
        plan = self.dispatcher.plan(items, exclude=down)  # dupes once; costs, loads, affinity
        groups = plan.groups
        sent_at = time.time()  # the ranks' queue wait starts here (wall clock: other processes)
        calls = [
            Stamped(
                self.ranks[rank].encode.remote(
                    [sources[i] for i in idx],
                    [items[i] for i in idx],
                    sent_at=sent_at,
                    caller=self.dispatcher.caller,
                )
            )
            for rank, idx in groups.items()
        ]
        in_flight = self.metrics.dispatched(dispatch_loads(groups, items))
        with in_flight, self.dispatcher.dispatched(plan):
            results = await settle_within(calls, deadline - time.monotonic(), timeout_s)
        got: dict[int, np.ndarray] = {}  # index in `items` -> features
        ok_ranks, ok_results, ok_calls, ms = [], [], [], {}
        first_error: BaseException | None = None
        for (rank, idx), result, call in zip(groups.items(), results, calls, strict=True):
            if isinstance(result, BaseException):
                if unavailable(result):
                    self.health.mark_down(rank, result)
                    continue
                first_error = first_error or result
                continue
            self.health.mark_up(rank)
            assert result["rank"] == rank and len(result["features"]) == len(idx), (rank, idx)
            ms[rank] = result["encode_ms"]
            self.dispatcher.observe(rank, result.get("load"))
            ok_ranks.append(rank)
            ok_results.append(result)
            ok_calls.append(call)
            for i, array in zip(idx, result["features"], strict=True):
                got[i] = array
        if first_error is not None:
            raise first_error  # an input error or an encoder failure: never retried
        if (trace := current_trace()) is not None:
            trace.ranks_done(ok_ranks, ok_results, ok_calls)
        self.dispatcher.record(plan, only=set(ok_ranks))
        attempt = _Attempt()
        for j, request_index in enumerate(pending):
            array = got.get(plan.first[j])  # a duplicate shares its first copy's array
            if array is None:
                attempt.pending.append(request_index)
            else:
                owner = plan.owners[j]
                attempt.done[request_index] = (array, owner, ms[owner])
        return attempt

    def _json(self, admitted, features, owners, timings, started) -> dict[str, Any]:
        out = []
        for i, (item, array, owner) in enumerate(
            zip(admitted.items, features, owners, strict=True)
        ):
            out.append(
                ItemFeatures(
                    index=i,
                    grid_thw=list(item.grid),
                    num_tokens=array.shape[0],
                    owner_rank=owner,
                    original_size=list(item.original_size) if item.original_size else None,
                    resized_size=_resized_size(item),
                    shape=list(array.shape),
                    data="",
                ).model_dump()
                | {"data": array}  # base64 written straight into the body (deployments/wire.py)
            )
        usage = Usage(
            images=len(out), patches=admitted.patches, tokens=sum(a.shape[0] for a in features)
        )
        timings["total"] = (time.perf_counter() - started) * 1e3
        return {
            "model": self.model_name,
            "items": out,
            "usage": usage.model_dump(),
            "timings_ms": {k: round(v, 3) for k, v in timings.items()},
        }

    def _safetensors(self, admitted, features, owners) -> bytes:
        tensors: dict[str, np.ndarray] = {}
        for i, (item, array) in enumerate(zip(admitted.items, features, strict=True)):
            tensors[f"features.{i}"] = np.ascontiguousarray(array, dtype=np.float32)
            tensors[f"grid_thw.{i}"] = np.asarray([item.grid], dtype=np.int64)
        meta = {"model": self.model_name, "owner_ranks": json.dumps(owners)}
        return safetensors_body(tensors, metadata=meta)  # one copy (deployments/wire.py)

    async def _rank_info(self, rank: int) -> dict[str, Any]:
        try:
            return await asyncio.wait_for(self.ranks[rank].info.remote(), timeout=10)
        except Exception as exc:  # noqa: BLE001 - a sick rank is reported, not raised
            return {"rank": rank, "state": "unavailable", "error": f"{type(exc).__name__}: {exc}"}
