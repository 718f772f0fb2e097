"""``model``: the checkpoint and how the ranks compute, and where image URLs may be fetched from."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from kimi_encoder.engines.media import FetchPolicy
from kimi_encoder.execution import ExecutionConfig, check_buckets, check_mode, default_buckets
from kimi_encoder.features import AUTO_RULE, FeatureDtype, auto_dtype
from kimi_encoder.hub import HubRef, is_hub
from kimi_encoder.items import resolve_backend

from .base import Section

# The library's execution defaults: the settings below read them (one home for each).
LIBRARY = ExecutionConfig()


class ImageUrlOptions(Section):
    """How the engine hand-off reads an http(s) image URL that a prefill forwards (sglang's
    ``mm_items``). Data URLs and base64 are always decoded locally; ``file://``, local
    paths and other schemes are always refused."""

    # Off by default: fetching a client's URL makes the server a client of anyone.
    allow_http: bool = Field(
        False, description="Fetch http(s) image URLs (one GET, no redirects); off: refused."
    )
    allow_private_networks: bool = Field(
        False,
        description="Also fetch from loopback, private and link-local addresses (checked "
        "after resolving the host); off: public addresses only.",
    )
    max_bytes: int = Field(64 << 20, ge=1, description="Largest image one URL may send.")
    timeout_s: float = Field(10.0, gt=0, description="Longest one URL fetch may take.")

    def policy(self) -> FetchPolicy:
        return FetchPolicy(**self.model_dump())


class ModelArgs(Section):
    """The checkpoint and how the ranks compute: read by every rank (its encoder) and by
    the ingress (the checkpoint's configs, the defaults of a request)."""

    checkpoint: str = Field(
        "tiny",
        description="Kimi-K3/K2.5 checkpoint directory (original format), a hub repository "
        "hf://OWNER/NAME[@REVISION] (each node fetches only its vision weights, once, into "
        "$HF_HOME/kimi-encoder), or a preset name (tiny, small, k3, k25). Presets get seeded "
        "random weights: meaningless features.",
    )
    seed: int = Field(0, description="Seed of the random weights of a preset checkpoint.")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto",
        description="Device of each rank; 'auto' means cuda when the ranks have GPUs "
        "(ranks.actor_options.num_gpus > 0), else cpu.",
    )
    dtype: Literal["auto", FeatureDtype] = Field(
        "auto", description=f"Weights and compute dtype of the ranks; 'auto': {AUTO_RULE}."
    )
    feature_dtype: FeatureDtype | None = Field(
        None,
        description="Element type of returned features unless a request asks for another; "
        "None: the model's dtype (each rank casts on its device before the copy to host).",
    )
    preprocess_backend: str = Field(
        "auto",
        description="Default pixel pipeline: 'gpu' (torch ops on the rank's device), 'cpu' "
        "(PIL) or 'auto' (gpu on a cuda rank, else cpu). Requests may override with gpu/cpu.",
    )

    execution: str = Field(
        "auto",
        description="How each rank runs the tower: 'eager', 'compiled' (torch.compile of the "
        "pieces between attention calls), 'graphs' (CUDA graphs over patch buckets; CUDA, "
        "bfloat16 or float16, compute capability 8.0+) or 'auto' (eager on CPU; on CUDA the "
        "fastest the rank measures at start within auto_budget_s). docs/gpu.md.",
    )
    graph_buckets: list[int] = Field(
        [],
        description="Patch budgets of the CUDA graphs ('graphs', or 'auto' measuring it); "
        "empty: ranks.batching.max_batch_patches halved down to 512, at most 8 budgets.",
    )
    graph_max_images: int = Field(
        LIBRARY.graph_max_images,
        ge=1,
        description="Most images in one graph's batch; a batch with more runs eager.",
    )
    auto_budget_s: float = Field(
        LIBRARY.auto_budget_s,
        ge=0,
        description="Seconds a CUDA rank's 'auto' may spend building (compiling, capturing, "
        "waiting for another rank's compile) and timing the modes at start; read between "
        "steps (one compiled piece, one bucket's graphs, one timing), so auto ends at most "
        "one step past it; a mode it stops is undone and skipped.",
    )

    @field_validator("checkpoint")
    @classmethod
    def _hub_name(cls, value: str) -> str:
        if is_hub(value):
            HubRef.parse(value)  # raises the library's malformed-name error
        return value

    @field_validator("preprocess_backend")
    @classmethod
    def _known_backend(cls, value: str) -> str:
        resolve_backend(value, "cpu")  # raises the library's unsupported-backend error
        return value

    @field_validator("execution")
    @classmethod
    def _known_execution(cls, value: str) -> str:
        return check_mode(value)  # raises the library's unknown-execution error

    @field_validator("graph_buckets")
    @classmethod
    def _bucket_sizes(cls, value: list[int]) -> list[int]:
        if value:  # empty: derived from the batch budget
            check_buckets(value)  # raises the library's error
        return value

    def execution_config(
        self, max_batch_patches: int, compile_threads: int | None = None
    ) -> ExecutionConfig:
        """The library's execution config of a rank batching up to ``max_batch_patches``,
        compiling with at most ``compile_threads`` workers (its CPUs; None: its process's)."""
        return ExecutionConfig(
            mode=self.execution,
            graph_buckets=tuple(self.graph_buckets or default_buckets(max_batch_patches)),
            graph_max_images=self.graph_max_images,
            auto_budget_s=self.auto_budget_s,
            compile_threads=compile_threads,
        )

    def resolved(self, num_gpus: float) -> ModelArgs:
        """This section as ranks with ``num_gpus`` GPUs each run it: no 'auto', no None."""
        device = self.device if self.device != "auto" else ("cuda" if num_gpus > 0 else "cpu")
        dtype = self.dtype if self.dtype != "auto" else auto_dtype(device)
        return self.model_copy(
            update={
                "device": device,
                "dtype": dtype,
                "feature_dtype": self.feature_dtype or dtype,
                "preprocess_backend": resolve_backend(self.preprocess_backend, device),
            }
        )
