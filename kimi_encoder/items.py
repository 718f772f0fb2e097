"""Encoder items and admission: modality check, splitting, header-only grids.

An item is one image with exactly one grid row ``(1, gh, gw)``. Admission runs
where requests arrive (cheap: it reads image headers, never pixels); the
expensive preprocessing is deferred to the rank that owns the item.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import numbers
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch
from PIL import Image

from . import headers
from .config import PreprocessConfig

BACKENDS = ("gpu", "cpu")

MSG_IMAGE_ONLY = "Kimi-K3 encoder mode supports image input only"
MSG_ONE_GRID = (
    "Kimi-K3 expects one vision grid per MultimodalDataItem; "
    "split aggregated encoder inputs before get_image_feature()"
)
MSG_LENGTH = "Kimi-K3 deferred feature length does not match image grids"


class EncoderInputError(ValueError):
    """A request's content is invalid (HTTP 400). ``item`` is the offending index."""

    def __init__(self, message: str, item: int | None = None):
        super().__init__(message if item is None else f"item {item}: {message}")
        self.item = item


class LimitExceededError(EncoderInputError):
    """A request is over a configured limit (HTTP 413)."""


class UnsupportedFormatError(EncoderInputError):
    """An image file in a format the server does not read (HTTP 415)."""

    @classmethod
    def detected(cls, fmt: str, data: bytes, index: int | None = None) -> UnsupportedFormatError:
        """The refusal of ``data``, whose signature says ``fmt`` (a name, or 'unknown')."""
        if fmt == "unknown":
            what = (
                f"cannot read the image header: {len(data)} bytes in an unknown format "
                f"(first bytes {data[:8].hex(' ')})"
            )
        else:
            what = f"image format {fmt} is not accepted ({len(data)} bytes)"
        return cls(
            f"{what}; the server reads {headers.FORMAT_LIST} files, recognised by their "
            "signature (not by name or media type); convert the image to one of them.",
            index,
        )


class Modality(str, Enum):
    IMAGE = "image"
    VIDEO = "video"
    AUDIO = "audio"


def unsupported_backend(backend: Any) -> ValueError:
    return ValueError(
        f"Unsupported Kimi-K3 deferred preprocessing backend: {backend}; "
        f"allowed: {', '.join(BACKENDS)} ('auto' only in configuration)."
    )


def resolve_backend(backend: str, device: torch.device | str | None = None) -> str:
    """Configuration-level backend: 'auto' picks 'gpu' on a CUDA device, else 'cpu'."""
    if backend == "auto":
        on_cuda = (
            torch.device(device).type == "cuda"
            if device is not None
            else (torch.cuda.is_available())
        )
        return "gpu" if on_cuda else "cpu"
    if backend not in BACKENDS:
        raise unsupported_backend(backend)
    return backend


@dataclass(frozen=True)
class ResizeConfig:
    new_width: int
    new_height: int
    pad_width: int
    pad_height: int
    num_tokens: int

    def grid_thw(self, patch_size: int) -> tuple[int, int, int]:
        return (
            1,
            (self.new_height + self.pad_height) // patch_size,
            (self.new_width + self.pad_width) // patch_size,
        )


def navit_resize(width: int, height: int, cfg: PreprocessConfig) -> ResizeConfig:
    """Target size, padding and token count from the original size alone.

    Only ever downscales: the scale is capped by the patch budget
    (``in_patch_limit``, checked before padding) and the per-side limit.

    >>> navit_resize(1920, 1080, PreprocessConfig()).grid_thw(14)
    (1, 78, 138)
    """
    p, side = cfg.patch_size, cfg.patch_limit_on_one_side
    scale = min(
        1.0,
        math.sqrt(cfg.in_patch_limit / (max(1.0, width // p) * max(1.0, height // p))),
        side * p / width,
        side * p / height,
    )
    new_w = min(max(1, int(width * scale)), side * p)
    new_h = min(max(1, int(height * scale)), side * p)
    factor = cfg.merge_kernel_size * p
    pad_w = (factor - new_w % factor) % factor
    pad_h = (factor - new_h % factor) % factor
    tokens = ((new_h + pad_h) // factor) * ((new_w + pad_w) // factor)
    if cfg.fixed_output_tokens is not None:
        tokens = cfg.fixed_output_tokens
    return ResizeConfig(new_w, new_h, pad_w, pad_h, tokens)


@dataclass(frozen=True)
class DeferredPreprocessing:
    """What the owner rank needs to finish one image."""

    backend: str
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    transparent_bg_config: dict | None
    resize_config: ResizeConfig
    fill_stage: str = "after_resize"
    # The admitted pixel limit, checked again from the header before the rank decodes.
    max_pixels: int | None = None

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise unsupported_backend(self.backend)


@dataclass
class EncoderItem:
    """One unit of encoder work.

    Either a raw image (``image`` holds the encoded file bytes and ``deferred``
    says how to preprocess it) or preprocessed ``pixel_values`` of shape
    ``(sum t*h*w, 3, p, p)``. ``grid_thws`` has one row per image; the encoder
    only accepts items with exactly one row.
    """

    grid_thws: torch.Tensor  # (k, 3) int64
    image: bytes | None = None
    pixel_values: torch.Tensor | None = None
    deferred: DeferredPreprocessing | None = None
    modality: Modality = Modality.IMAGE
    original_size: tuple[int, int] | None = None  # (width, height)
    meta: dict[str, Any] = field(default_factory=dict)
    # SHA-256 of ``image``, set by ``image_digest`` the first time it is needed; pickled with
    # the item, so the rank reuses the digest its ingress computed. ``dataclasses.replace``
    # does not copy it (init=False): a replaced item computes its own.
    image_sha256: bytes | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def grid(self) -> tuple[int, int, int]:
        if self.grid_thws.shape[0] != 1:
            raise ValueError(MSG_ONE_GRID)
        t, h, w = (int(v) for v in self.grid_thws[0].tolist())
        return t, h, w

    @property
    def num_patches(self) -> int:
        return int(self.grid_thws.prod(dim=1).sum())

    def image_digest(self) -> bytes:
        """SHA-256 of the encoded image bytes (computed once per item)."""
        if self.image_sha256 is None:
            if self.image is None:
                raise ValueError("an item without image bytes has no image digest")
            self.image_sha256 = hashlib.sha256(self.image).digest()
        return self.image_sha256

    def by_digest(self) -> EncoderItem:
        """This image item without its file bytes, for a rank whose feature cache holds
        its features: the rank finds them by the digest (and the rest of the cache key,
        all kept) and answers that it no longer has them if they were evicted."""
        if not self.can_go_by_digest:
            raise ValueError("only an image item with its bytes can be sent by digest")
        digest = self.image_digest()
        out = dataclasses.replace(self, image=None)
        out.image_sha256 = digest  # init=False: replace does not carry it
        return out

    @property
    def can_go_by_digest(self) -> bool:
        """An image item with its file bytes and deferred record (``by_digest`` applies)."""
        return self.image is not None and self.deferred is not None

    @property
    def sent_by_digest(self) -> bool:
        """An image item whose bytes were left behind (``by_digest``)."""
        return self.image is None and self.pixel_values is None and self.image_sha256 is not None

    # Items cross process boundaries (ingress -> rank) by pickle. A tensor pickles through
    # torch's storage serializer, which costs more than the rest of an image item together
    # (its file bytes included; docs/api.md, "Measurements behind the code"). An int64 grid
    # (every grid admission makes) travels as nested lists of ints instead.
    def __getstate__(self) -> dict[str, Any]:
        grid = self.grid_thws
        if grid.dtype != torch.int64 or grid.device.type != "cpu":
            return dict(self.__dict__)
        return {**self.__dict__, "grid_thws": (tuple(grid.shape), grid.flatten().tolist())}

    def __setstate__(self, state: dict[str, Any]) -> None:
        grid = state["grid_thws"]
        if isinstance(grid, tuple):  # (shape, values) from __getstate__
            shape, values = grid
            grid = torch.tensor(values, dtype=torch.int64).reshape(shape)
        self.__dict__.update(state, grid_thws=grid)


def check_modality(modality: str | Modality, index: int | None = None) -> Modality:
    """Admission's modality gate: anything but an image is refused."""
    value = modality.value if isinstance(modality, Modality) else str(modality)
    if value != Modality.IMAGE.value:
        raise EncoderInputError(
            f"{MSG_IMAGE_ONLY}; got modality {value!r}. Send each image as an item of "
            "type 'image' and encode other media elsewhere.",
            index,
        )
    return Modality.IMAGE


def check_pixels(width: int, height: int, max_pixels: int | None, index: int | None = None) -> None:
    """Refuse a ``width x height`` image over ``max_pixels`` (413), before any decode."""
    if max_pixels is not None and width * height > max_pixels:
        raise LimitExceededError(
            f"image is {width}x{height} = {width * height} pixels, over the limit "
            f"max_image_pixels={max_pixels}; downscale it before sending.",
            index,
        )


def read_image_size(data: bytes, max_pixels: int | None = None, index: int | None = None):
    """(width, height, format) from the file header; pixels are not decoded.

    The format is detected from the file's signature and must be one of
    ``headers.FORMATS``; the size is parsed by ``headers`` without Pillow. PIL's
    bomb limit still applies: above ``2 * Image.MAX_IMAGE_PIXELS`` the image is
    refused; the band between is our ``max_pixels`` check's business when a
    limit is given, refused otherwise.
    """
    if not data:
        raise EncoderInputError("image data is empty (0 bytes); send a PNG/JPEG/WebP file.", index)
    fmt = headers.detect_format(data)
    if fmt not in headers.FORMATS:
        raise UnsupportedFormatError.detected(fmt, data, index)
    try:
        width, height = headers.header_size(data, fmt)
    except headers.HeaderError as exc:
        raise EncoderInputError(
            f"cannot read the image header ({exc}); send a valid {headers.FORMAT_LIST} file.",
            index,
        ) from None
    if width < 1 or height < 1:
        raise EncoderInputError(
            f"image has an empty size {width}x{height} ({fmt} header); send an image of at "
            "least 1x1 pixels.",
            index,
        )
    limit = Image.MAX_IMAGE_PIXELS  # PIL's bomb limit, doubled when max_pixels is ours to check
    if limit is not None and width * height > (over := limit if max_pixels is None else 2 * limit):
        named = "" if max_pixels is None else f"max_image_pixels={max_pixels}; "
        raise LimitExceededError(
            f"image header claims a decompression bomb: {width}x{height} = {width * height} "
            f"pixels, over PIL's limit of {over}; {named}send a smaller image.",
            index,
        )
    check_pixels(width, height, max_pixels, index)
    return width, height, fmt


def plan_image(
    data: bytes,
    cfg: PreprocessConfig,
    backend: str,
    *,
    max_pixels: int | None = None,
    index: int | None = None,
) -> EncoderItem:
    """Admit one encoded image: read its size, compute its grid, defer the rest."""
    width, height, _ = read_image_size(data, max_pixels, index)
    resize = navit_resize(width, height, cfg)
    deferred = DeferredPreprocessing(
        backend=backend,
        image_mean=cfg.image_mean,
        image_std=cfg.image_std,
        transparent_bg_config=cfg.transparent_bg_config,
        resize_config=resize,
        fill_stage=cfg.transparent_bg_fill_stage,
        max_pixels=max_pixels,
    )
    grid = torch.tensor([resize.grid_thw(cfg.patch_size)], dtype=torch.int64)
    return EncoderItem(grid, image=data, deferred=deferred, original_size=(width, height))


INT64_MAX = 2**63 - 1


def check_grid_rows(
    grid_thws: Any, merge_kernel_size: tuple[int, int], index: int | None = None
) -> torch.Tensor:
    """Validate a client-supplied (k, 3) grid table of images; the table as int64.

    Checked in Python integers before any tensor exists, so nothing wraps: a
    ragged table, a non-integer (booleans included) or a value whose patch
    count ``t*h*w`` (or the table's running sum) passes int64 is refused, naming
    the row.
    """
    rows = grid_thws.tolist() if hasattr(grid_thws, "tolist") else grid_thws  # tensor, array
    if (
        not isinstance(rows, (list, tuple))
        or not rows
        or not all(isinstance(row, (list, tuple)) for row in rows)
    ):
        raise EncoderInputError(
            f"grid_thws must be a non-empty list of [t, h, w] rows, got {_clip(rows)}.", index
        )
    kh, kw = merge_kernel_size
    checked, total = [], 0
    for r, row in enumerate(rows):
        if len(row) != 3:
            raise EncoderInputError(
                f"grid_thws row {r} is {_clip(row)} with {len(row)} values; every row is "
                "[t, h, w].",
                index,
            )
        if not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in row):
            raise EncoderInputError(
                f"grid_thws row {r} is {_clip(row)}; grid_thws must hold integers (no "
                "booleans, floats or strings).",
                index,
            )
        t, h, w = (int(v) for v in row)
        if t != 1:
            raise EncoderInputError(
                f"grid_thws row {r} is [{t}, {h}, {w}] with t={_clip(t)}; images have t=1 "
                "(video is not served).",
                index,
            )
        if h < kh or w < kw or h % kh or w % kw:
            raise EncoderInputError(
                f"grid_thws row {r} is [{t}, {_clip(h)}, {_clip(w)}]; h and w must be positive "
                f"multiples of the merge kernel {kh}x{kw}.",
                index,
            )
        total += t * h * w
        if total > INT64_MAX:
            raise EncoderInputError(
                f"grid_thws row {r} is [{t}, {_clip(h)}, {_clip(w)}]: the rows need {_clip(total)} "
                "patches, past int64; send grids that match the pixel_values rows.",
                index,
            )
        checked.append((t, h, w))
    return torch.tensor(checked, dtype=torch.int64)


def _clip(value: Any, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters for an error message."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def split_pixel_values(
    pixel_values: torch.Tensor, grid_thws: torch.Tensor, index: int | None = None
) -> list[EncoderItem]:
    """Split an aggregated item (k grids, rows concatenated) into k items.

    Rows are split by each grid's ``t*h*w``, computed in Python integers (a
    product past int64 cannot wrap into a plausible row count); a row count
    that does not match the grids raises the feature-length error.
    """
    sizes = [t * h * w for t, h, w in grid_thws.tolist()]
    if pixel_values.shape[0] != sum(sizes):
        raise EncoderInputError(
            f"{MSG_LENGTH}: pixel_values has {pixel_values.shape[0]} rows but the grids "
            f"{_clip(grid_thws.tolist(), 200)} need {sum(sizes)}; send one row per patch.",
            index,
        )
    return [
        EncoderItem(grid_thws[i : i + 1].clone(), pixel_values=rows)
        for i, rows in enumerate(pixel_values.split(sizes))
    ]
