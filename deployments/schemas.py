"""HTTP request and response models of the encode server (they drive the OpenAPI page)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictInt,
    Tag,
    model_validator,
)

from kimi_encoder.features import (
    FEATURE_DTYPES,
    PIXEL_DTYPE,
    SAFETENSORS,
    FeatureDtype,
    PixelDtype,
)

from .vllm_push import VllmPushOutput

ResponseFormat = Literal["json", "safetensors"]

_PNG_1X1 = (
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC"
)


class PixelValues(BaseModel):
    """Preprocessed patches of one or more images, rows concatenated."""

    model_config = ConfigDict(extra="forbid")

    data: str = Field(description="Base64 of the little-endian array bytes, C order.")
    shape: list[Annotated[int, Field(le=2**31 - 1)]] = Field(
        min_length=4,
        max_length=4,
        description="[rows, 3, patch, patch]; rows = sum of t*h*w (below 2**31).",
    )
    dtype: PixelDtype = Field(PIXEL_DTYPE, description=f"Element type; only {PIXEL_DTYPE}.")


class ImageItem(BaseModel):
    """One image: an encoded file, or preprocessed pixel values with their grids."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"examples": [{"type": "image", "image": _PNG_1X1}]},
    )

    type: Literal["image"] = Field(description="Modality; only 'image' is served.")
    image: str | None = Field(
        None, description="Encoded image file (PNG, JPEG, WebP, ...) as base64 or a data: URL."
    )
    pixel_values: PixelValues | None = Field(
        None, description="Preprocessed patches; an item with k grids is split into k images."
    )
    grid_thws: list[list[StrictInt]] | None = Field(
        None,
        description="One [1, h, w] row of JSON integers per image in pixel_values (patches "
        "per side).",
    )

    @model_validator(mode="after")
    def _one_source(self) -> ImageItem:
        if (self.image is None) == (self.pixel_values is None):
            raise ValueError(
                "an image item needs exactly one of 'image' (encoded file) or 'pixel_values' "
                "(with 'grid_thws')."
            )
        if (self.pixel_values is None) != (self.grid_thws is None):
            raise ValueError("'grid_thws' goes with 'pixel_values' and only with it.")
        return self


class OtherItem(BaseModel):
    """Any other modality (video, audio, ...): accepted by the schema, refused with 400."""

    model_config = ConfigDict(extra="allow")

    type: str = Field(description="Modality name; anything but 'image' is refused.")


def _item_kind(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return "image" if kind == "image" else "other"


Item = Annotated[
    Annotated[ImageItem, Tag("image")] | Annotated[OtherItem, Tag("other")],
    Discriminator(_item_kind),
]


class VllmEcOutput(BaseModel):
    """Write each item's features as a vLLM encoder-cache entry instead of returning them."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["vllm_ec"] = Field(
        description="vLLM 0.33.0 ECExampleConnector files under the server's ec_root."
    )
    uuids: list[str] = Field(
        min_length=1,
        description="One identifier per item after splitting, in order: the uuid the client "
        "puts on the image's content part for the consumer (its mm_hash); each names one "
        "directory under ec_root.",
    )


class EncodeRequest(BaseModel):
    """JSON body of ``POST /v1/encode``."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {"items": [{"type": "image", "image": _PNG_1X1}], "response_format": "json"}
            ]
        },
    )

    items: list[Item] = Field(min_length=1, description="Items to encode, answered in order.")
    response_format: ResponseFormat = Field(
        "json", description="'json' (base64 of the features' bytes) or 'safetensors' (binary body)."
    )
    backend: str | None = Field(
        None, description="Preprocessing backend for this request: 'gpu' or 'cpu'."
    )
    feature_dtype: FeatureDtype | None = Field(
        None,
        description=f"Element type of the returned features: {', '.join(FEATURE_DTYPES)}; "
        "default: the server's feature_dtype (the model's dtype unless configured).",
    )
    output: Annotated[VllmEcOutput | VllmPushOutput, Field(discriminator="kind")] | None = Field(
        None,
        description="Where features go: null returns them; 'vllm_ec' writes vLLM "
        "encoder-cache files in the model's dtype before answering, and answers metadata "
        "only (EcWriteResponse); 'vllm_push' pushes them to vLLM workers and answers once "
        "each acknowledged (EcPushResponse).",
    )


class ItemFeatures(BaseModel):
    index: int = Field(description="Position of this image in the request, after splitting.")
    grid_thw: list[int] = Field(description="[1, h, w] patch grid of the image.")
    num_tokens: int = Field(description="Feature rows: h*w/4.")
    owner_rank: int = Field(description="Encoder rank that encoded this image.")
    original_size: list[int] | None = Field(
        None, description="[width, height] of the encoded file; null for pixel_values items."
    )
    resized_size: list[int] | None = Field(
        None, description="[width, height] after the NaViT resize, before padding to the grid."
    )
    shape: list[int] = Field(description="[num_tokens, text_hidden_size].")
    dtype: FeatureDtype = Field(
        description="Element type of 'data' (bfloat16 as raw 2-byte words)."
    )
    data: str = Field(
        description="Base64 of the features' little-endian bytes, row after row (bfloat16: "
        "each value's upper 16 bits of its float32)."
    )


class Usage(BaseModel):
    images: int = Field(description="Images encoded.")
    patches: int = Field(description="Sum of t*h*w over the images.")
    tokens: int = Field(description="Feature rows returned.")


class EncodeResponse(BaseModel):
    """JSON answer of ``POST /v1/encode``."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "model": "preset:tiny",
                    "items": [
                        {
                            "index": 0,
                            "grid_thw": [1, 2, 2],
                            "num_tokens": 1,
                            "owner_rank": 0,
                            "shape": [1, 80],
                            "dtype": FEATURE_DTYPES[0],
                            "data": "AAAAAA...",
                        }
                    ],
                    "usage": {"images": 1, "patches": 4, "tokens": 1},
                    "timings_ms": {"admit": 0.4, "encode": 12.1, "total": 13.0, "rank_0": 10.2},
                }
            ]
        }
    )

    model: str = Field(description="Checkpoint name, or 'preset:NAME'.")
    items: list[ItemFeatures] = Field(description="One entry per image, in request order.")
    usage: Usage
    timings_ms: dict[str, float] = Field(
        description="admit (ingress checks), encode (fan-out to ranks and back), total, and "
        "rank_R (model time of each rank called)."
    )


class EcEntry(BaseModel):
    index: int = Field(description="Position of this image in the request, after splitting.")
    uuid: str = Field(description="The entry's identifier (its directory under ec_root).")
    path: str = Field(description="The file, relative to ec_root.")
    grid_thw: list[int] = Field(description="[1, h, w] patch grid of the image.")
    num_tokens: int = Field(description="Rows of the entry's ec_cache tensor.")
    owner_rank: int = Field(description="Encoder rank that encoded this image.")
    shape: list[int] = Field(description="[num_tokens, text_hidden_size].")
    dtype: FeatureDtype = Field(description="Element type stored: the model's dtype.")
    bytes: int = Field(description="Size of the file written.")


class EcWriteResponse(BaseModel):
    """JSON answer of ``POST /v1/encode`` with output kind 'vllm_ec': the files are complete
    (renamed into place and synced) when it is sent."""

    model: str = Field(description="Checkpoint name, or 'preset:NAME'.")
    items: list[EcEntry] = Field(description="One entry per image, in request order.")
    usage: Usage


class ErrorBody(BaseModel):
    type: str = Field(description="Error class, e.g. invalid_request, limit_exceeded.")
    message: str = Field(description="What was received, what is allowed and how to fix it.")


_VIDEO_ERROR = (
    "item 0: Kimi-K3 encoder mode supports image input only; got modality 'video'. "
    "Send each image as an item of type 'image' and encode other media elsewhere."
)


class ErrorResponse(BaseModel):
    error: ErrorBody

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "error": {
                        "type": "invalid_request",
                        "message": _VIDEO_ERROR,
                    }
                }
            ]
        }
    )


class RankInfo(BaseModel):
    model_config = ConfigDict(extra="allow")

    rank: int
    state: str = Field(
        description="As this ingress replica sees the rank: 'live' (taking work), 'draining' "
        "(given no new work: its replica is released once idle), 'starting', 'parked' (no "
        "replica), 'down' (failed, late or silent: see failover.down), or 'unavailable' "
        "(its info call failed, with an 'error'). Live and down ranks add their own report."
    )
    scaling_reason: str = Field("", description="Why the rank last started, drained or parked.")
    execution: dict[str, Any] | None = Field(
        None,
        description="How this rank runs the tower (model.execution): mode ('eager', "
        "'compiled' or 'graphs'), requested; for 'auto' on CUDA what was measured at start "
        "(measured_ms per mode on probe_patches, build_s, skipped with why); with graphs "
        "its buckets and the batches run in each or eagerly.",
    )


class InfoResponse(BaseModel):
    model: str
    variant: str = Field(description="'k3' or 'k25'.")
    hidden_size: int
    num_layers: int
    text_hidden_size: int = Field(description="Width of each feature row.")
    patch_size: int
    merge_kernel_size: list[int]
    dtype: str
    device: str
    preprocess_backend: str = Field(description="Default backend of requests.")
    dp_size: int = Field(description="Ranks there can be (dp_size, or its max when elastic).")
    ranks_live: list[int] = Field(
        description="Ranks with a running replica taking work from this ingress replica "
        "(elastic ranks: those the scaler wants that this replica finds up)."
    )
    scaling: dict[str, Any] | None = Field(
        None,
        description="Elastic ranks (null with a fixed dp_size), as the app's scaler decided "
        "them (the same from every ingress replica once it has heard): dp_min, dp_max, the "
        "ranks wanted, decided_by (the scaler's replica), decision (its number), "
        "decision_age_s, the queued work in seconds it decided on, target_queue_s, "
        "reports_age_s (the age of the newest load report of each rank and view of each "
        "ingress replica it weighed), the latest decisions (scale up or down, rank, why), "
        "and heard_s (since this replica last heard from the scaler).",
    )
    assignment: dict[str, Any] | None = Field(
        None,
        description="Owner assignment at this ingress replica: caller (the replica's id in "
        "the ranks' load reports), cost_model {a, b, c, source} (cost of a p-patch image: "
        "a*p^2 + b*p + c), current rank loads in that unit, affinity_tolerance, "
        "load_report_interval_ms.",
    )
    failover: dict[str, Any] | None = Field(
        None,
        description="Rank failures seen by this ingress replica: ranks_up, down (rank: "
        "reason), replicas (the replica each rank last answered from), unavailable_errors "
        "and recoveries per rank, redispatched_images, hedged_images, cooldown_s.",
    )
    ingress_cache: dict[str, Any] | None = Field(
        None,
        description="This ingress replica's cache of the ranks' cached features, held as "
        "read from the object store (ingress.cache_bytes; null when off): max_bytes, "
        "max_entries, bytes, entries, hits, misses, evictions.",
    )
    handoff: dict[str, Any] | None = Field(
        None,
        description="Engine hand-off: the pinned protocol versions (sglang, vllm), whether "
        "vllm_ec output is configured and whether image URLs are fetched.",
    )
    ranks: list[RankInfo] = Field(description="Each rank's own report (calls, items, device...).")


# --- OpenAPI of POST /v1/encode -------------------------------------------------------
# The route reads its body by hand (JSON or multipart, size-limited while it streams), so
# FastAPI cannot derive the request schema from a parameter: the route declares both
# bodies here, and ``document_request_models`` adds the models they refer to. (FastAPI
# routes by path and method, not by content type, so two routes cannot share the path.)

_ERROR_STATUSES = {
    400: "Invalid item, backend or data.",
    401: "Missing or wrong API key.",
    413: "Over a configured request limit.",
    415: "Body is neither JSON nor multipart.",
    422: "Malformed body.",
    500: "Encoder failure.",
    503: "A rank is unavailable or busy: retry after Retry-After seconds.",
    504: "Over request_timeout_s.",
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
        "feature_dtype": {"type": "string", "enum": list(FEATURE_DTYPES)},
    },
}
_SAFETENSORS_DOC = (
    f"safetensors file: features.{{i}} ({', '.join(SAFETENSORS.values())}: the feature "
    "dtype), grid_thw.{i} "
    "int64 [1, 3]; metadata 'owner_ranks' (JSON list) and 'model'."
)
# Keyword arguments of the route decorator.
ENCODE_OPENAPI: dict[str, Any] = {
    "response_model": EncodeResponse | EcWriteResponse,
    "responses": {
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
        **{s: {"model": ErrorResponse, "description": d} for s, d in _ERROR_STATUSES.items()},
    },
    "openapi_extra": {
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": {"$ref": "#/components/schemas/EncodeRequest"}},
                "multipart/form-data": {"schema": _MULTIPART_SCHEMA},
            },
        }
    },
}


def document_request_models(app: FastAPI) -> None:
    """Make ``app.openapi()`` include ``EncodeRequest`` and its parts in the components.

    A closure over ``app`` (not a module global), so the copy that ``serve.ingress``
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
