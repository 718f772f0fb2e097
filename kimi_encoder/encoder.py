"""``VisionEncoder``: checkpoint or preset in, per-image LLM features out.

``encode(items)`` plays the role of sglang's Kimi-K3 ``get_image_feature`` on
the owner rank: it refuses aggregated items, materializes each item's pixels
with its own backend, checks grids and lengths, and runs the tower and the
projector over all items packed into one batch (every layer runs once over all
their patches; attention stays within each image: one ``varlen_attn`` call per
layer for small images on a GPU, one SDPA call per image otherwise, see
``model.py``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from . import preprocess as pp
from .config import PRESETS, PreprocessConfig, VisionConfig, resolve_configs
from .execution import ExecutionConfig, check_execution, prepare
from .features import AUTO_RULE, FEATURE_DTYPES, auto_dtype, dtype_name, torch_dtype
from .hub import HubRef, fetch, is_hub, log_progress
from .items import (
    MSG_LENGTH,
    MSG_ONE_GRID,
    DeferredPreprocessing,
    EncoderItem,
    plan_image,
    resolve_backend,
)
from .weights import load_model, random_model

log = logging.getLogger(__name__)

# Runs the host's share of one image's preprocessing: (file bytes, its record, patch size)
# -> what ``preprocess.device_stage`` finishes.
HostStageFn = Callable[[bytes, DeferredPreprocessing, int], pp.HostStage]


@dataclass
class Prepared:
    """What ``VisionEncoder.prepare`` hands to ``materialize``: an item's pixels, the grid
    they form, and, when a side stream made them, the event that says they are ready."""

    pixels: torch.Tensor
    grid: tuple[int, int, int]
    ready: torch.cuda.Event | None = None


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"device {str(device)!r} requested but CUDA is not available on this machine; "
            "use device 'cpu' or 'auto'."
        )
    return dev


def resolve_dtype(dtype: str | torch.dtype, device: torch.device | None = None) -> torch.dtype:
    """A dtype name or torch dtype; 'auto' follows ``device`` (``features.auto_dtype``)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch_dtype(auto_dtype(torch.device(device or "cpu").type))
    if dtype not in FEATURE_DTYPES:
        raise ValueError(
            f"Unsupported dtype {dtype!r}; allowed: {', '.join(FEATURE_DTYPES)}, auto "
            f"({AUTO_RULE})."
        )
    return torch_dtype(dtype)


def exact_float32(device: torch.device, dtype: torch.dtype) -> None:
    """A float32 model on CUDA computes in float32: its matmuls are told to use IEEE
    float32 (``fp32_precision = "ieee"``), not TF32, whatever the process had set
    (``torch.set_float32_matmul_precision("high")``, say). The setting is the process's,
    so it is changed only for a float32 model on CUDA; bfloat16 and float16 models and
    CPU ones keep every fast path. The model has no convolution (the patch embedding is
    a matmul), so cuDNN's TF32 default does not reach it."""
    if torch.device(device).type != "cuda" or dtype != torch.float32:
        return
    matmul = torch.backends.cuda.matmul
    if matmul.fp32_precision != "ieee":
        log.info(
            "float32 model on CUDA: matmuls set to IEEE float32 (were %r)", matmul.fp32_precision
        )
        matmul.fp32_precision = "ieee"


class VisionEncoder:
    """Tower + projector on one device, with the checkpoint's preprocessing.

    ``execution`` says how the tower runs: 'eager', 'compiled', 'graphs' or 'auto', or an
    ``ExecutionConfig`` with its buckets and budget (``kimi_encoder.execution``); compiling,
    capturing or measuring happens here, before the first encode.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        vision: VisionConfig,
        preprocess: PreprocessConfig,
        *,
        name: str,
        backend: str = "auto",
        execution: str | ExecutionConfig = "auto",
    ):
        self.model = model
        self.vision = vision
        self.preprocess = preprocess
        self.name = name
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.backend = resolve_backend(backend, self.device)
        exact_float32(self.device, self.dtype)
        self.execution = prepare(model, execution)
        self._streams = threading.local()  # per-thread CUDA streams of prepare()
        # Where the weights came from (``from_pretrained`` sets it): /v1/info per rank.
        self.weights: dict = {"source": "given"}

    @classmethod
    def from_pretrained(
        cls,
        checkpoint: str | Path = "tiny",
        *,
        device: str | torch.device | None = "auto",
        dtype: str | torch.dtype = "auto",
        backend: str = "auto",
        seed: int = 0,
        execution: str | ExecutionConfig = "auto",
        hub_log: logging.Logger = log,
    ) -> VisionEncoder:
        """Load a checkpoint directory, fetch a hub checkpoint's vision weights
        (``hf://REPO[@REVISION]``, ``kimi_encoder.hub``; its progress and what it read to
        ``hub_log``), or build a preset with seeded random weights.

        ``dtype`` 'auto' follows the device (``features.auto_dtype``).
        """
        dev = resolve_device(device)
        dt = resolve_dtype(dtype, dev)
        # Fail fast on a bad backend or execution, before loading weights.
        resolve_backend(backend, dev)
        execution = ExecutionConfig.of(execution)
        check_execution(execution, dev, dt)
        weights: dict = {"source": str(checkpoint)}
        if is_hub(checkpoint):  # fetched once per node and commit, then a local directory
            ref = HubRef.parse(str(checkpoint))
            fetched = fetch(ref, progress=log_progress(str(ref), hub_log))
            hub_log.info("%s", fetched.summary())
            weights, checkpoint = fetched.info(), fetched.path
        vision, preprocess, name = resolve_configs(checkpoint)
        if str(checkpoint) in PRESETS:
            log.warning(
                "Preset %r uses seeded random weights (seed %d): its features are meaningless; "
                "pass a checkpoint directory for real ones.",
                str(checkpoint),
                seed,
            )
            model = random_model(vision, seed, dev, dt)
            weights["seed"] = seed
        else:
            model = load_model(checkpoint, vision, dev, dt)
        encoder = cls(
            model,
            vision,
            preprocess,
            name=weights.get("repo", name),
            backend=backend,
            execution=execution,
        )
        encoder.weights = weights
        return encoder

    def plan(self, data: bytes, backend: str | None = None, **limits) -> EncoderItem:
        """Admit one encoded image (header only) with this encoder's preprocessing."""
        chosen = self.backend if backend is None else resolve_backend(backend, self.device)
        return plan_image(data, self.preprocess, chosen, **limits)

    def prepare(self, item: EncoderItem, host_stage: HostStageFn = pp.host_stage) -> Prepared:
        """An item's pixels, computed on any thread: its file decoded and preprocessed with
        its backend (the ``gpu`` backend's torch ops on this encoder's device, on a side
        stream of the calling thread when that is a GPU, so they overlap the forward).
        ``host_stage`` runs the host's share (``preprocess.host_stage``: decode, and the
        whole cpu backend); ``DecodeProcesses.host_stage`` runs it in a worker process.
        ``materialize`` hands the pixels to the forward, checked."""
        if item.pixel_values is not None:
            return Prepared(item.pixel_values, item.grid)
        if item.deferred is None or item.image is None:
            raise ValueError(
                "an image item needs encoded image bytes and its deferred "
                "preprocessing record; build it with plan_image()."
            )
        patch = self.vision.patch_size
        host = host_stage(item.image, item.deferred, patch)
        if item.deferred.backend == "cpu" or self.device.type != "cuda":
            device = "cpu" if item.deferred.backend == "cpu" else self.device
            return Prepared(*pp.device_stage(host, item.deferred, patch, device))
        stream = self._side_stream()
        with torch.cuda.stream(stream):
            pixels, grid = pp.device_stage(host, item.deferred, patch, self.device)
            ready = torch.cuda.Event()
            ready.record(stream)
        return Prepared(pixels, grid, ready)

    def materialize(
        self, items: Sequence[EncoderItem], prepared: Sequence[Prepared] | None = None
    ) -> list[torch.Tensor]:
        """Pixel values ``(t*h*w, 3, p, p)`` of each item on the device, checked; from its
        ``prepare`` result when given."""
        patch = self.vision.patch_size
        out: list[torch.Tensor] = []
        for i, item in enumerate(items):
            host = self.prepare(item) if prepared is None else prepared[i]
            pixels = host.pixels
            if host.ready is not None:  # made on a side stream: this stream waits for it
                current = torch.cuda.current_stream(self.device)
                current.wait_event(host.ready)
                pixels.record_stream(current)
            pixels = pixels.to(self.device, torch.float32)
            if item.pixel_values is not None:
                if pixels.ndim != 4 or tuple(pixels.shape[1:]) != (3, patch, patch):
                    raise ValueError(
                        f"pixel_values must have shape (rows, 3, {patch}, {patch}), got "
                        f"{tuple(pixels.shape)}."
                    )
            elif host.grid != item.grid:
                raise ValueError(
                    f"Kimi-K3 deferred {item.deferred.backend.upper()} preprocessing produced "
                    f"wrong grids: {list(host.grid)} != admitted {list(item.grid)}"
                )
            if pixels.shape[0] != item.num_patches:
                raise ValueError(f"{MSG_LENGTH}: {pixels.shape[0]} != {item.num_patches}")
            out.append(pixels)
        return out

    def _side_stream(self) -> torch.cuda.Stream:
        """The calling thread's own CUDA stream for preprocessing (one per thread)."""
        stream = getattr(self._streams, "stream", None)
        if stream is None:
            stream = self._streams.stream = torch.cuda.Stream(self.device)
        return stream

    @torch.inference_mode()
    def encode(self, items: Sequence[EncoderItem]) -> list[torch.Tensor]:
        """One ``(gh*gw/4, text_hidden)`` tensor per item, in input order (model dtype)."""
        for item in items:
            if item.grid_thws.ndim != 2 or item.grid_thws.shape[0] != 1:
                raise ValueError(MSG_ONE_GRID)
        return self.forward(self.materialize(items), items)

    @torch.inference_mode()
    def forward(
        self, pixels: Sequence[torch.Tensor], items: Sequence[EncoderItem]
    ) -> list[torch.Tensor]:
        """Tower and projector over already materialized items, packed into one batch."""
        if not items:
            return []
        grids = [item.grid for item in items]
        features = self.execution(torch.cat(list(pixels)), grids)
        counts = [self.vision.num_tokens(item.grid) for item in items]
        assert features.shape[0] == sum(counts), (tuple(features.shape), counts)
        return list(features.split(counts))

    @torch.inference_mode()
    def time_forward(self, side: int) -> None:
        """Run tower and projector on one synthetic ``side x side``-patch image (calibration)."""
        p = self.vision.patch_size
        pixels = torch.zeros(side * side, 3, p, p, device=self.device)
        self.execution(pixels, [(1, side, side)])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def info(self) -> dict:
        return {
            "model": self.name,
            **self.vision.summary(),
            "dtype": dtype_name(self.dtype),
            "device": str(self.device),
            "backend": self.backend,
            "parameters": sum(p.numel() for p in self.model.parameters()),
            "execution": self.execution.info(),
            "weights": self.weights,
        }
