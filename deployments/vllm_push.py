"""Output kind ``vllm_push``: features pushed by the ranks into vLLM workers' encoder caches.

A ``/v1/encode`` request with ``"output": {"kind": "vllm_push", "uuids": [...], "to":
["host:port", ...]}`` names one uuid per image (the mm_hash the client puts on the
image's content part) and every worker of the vLLM engine that will serve the chat
request (one per TP rank, each running ``kimi_encoder.engines.vllm_connector``). The
ingress checks each address against ``handoff.receive_networks`` before anything is
encoded (400, nothing connects); the rank that encodes an image pushes it to every
worker under each uuid it stands for, from its host buffer or, for a cache hit, from the
object store in place, and answers only once every worker acknowledged it. The ingress
answers the metadata; no feature byte passes through it.

A push that fails or is not acknowledged within ``handoff.vllm_push.ack_timeout_s`` fails
the request with 503, naming the item, the worker and the reason (never a local encode
on vLLM's side: its scheduler waits for the items, and fails the chat request if they
never come). A rank that dies mid-push is a lost rank like any other: the fan-out sends
its images to a live rank, which encodes and pushes them again.

Ray-free except ``PushMetrics`` (Serve's metrics objects, made in the rank).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import JSONResponse

from kimi_encoder.engines.ecpush import EcPusher
from kimi_encoder.engines.transport import ReceivePolicy
from kimi_encoder.features import FeatureDtype
from kimi_encoder.items import EncoderInputError

MAX_DESTINATIONS = 64


class VllmPushOutput(BaseModel):
    """Push each item's features to vLLM workers instead of returning them."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["vllm_push"] = Field(
        description="Features pushed to vLLM 0.33.0 workers running kimi-encoder's connector "
        "(kimi_encoder.engines.vllm_connector), acknowledged before the answer."
    )
    uuids: list[str] = Field(
        min_length=1,
        description="One identifier per item after splitting, in order: the uuid the client "
        "puts on the image's content part for the consumer (its mm_hash).",
    )
    to: list[str] = Field(
        min_length=1,
        max_length=MAX_DESTINATIONS,
        description="'host:port' of every worker of the vLLM engine that serves the chat "
        "request: ec_ip:ec_port + dp_index x tp_size + tp_rank, one per TP rank.",
    )


class PushedEntry(BaseModel):
    index: int = Field(description="Position of this image in the request, after splitting.")
    uuid: str = Field(description="The identifier it was pushed under (its mm_hash in vLLM).")
    grid_thw: list[int] = Field(description="[1, h, w] patch grid of the image.")
    num_tokens: int = Field(description="Rows of the features pushed.")
    owner_rank: int = Field(description="Encoder rank that encoded and pushed this image.")
    shape: list[int] = Field(description="[num_tokens, text_hidden_size].")
    dtype: FeatureDtype = Field(description="Element type pushed: the model's dtype.")
    bytes: int = Field(description="Feature bytes pushed to each worker.")
    acked_by: list[str] = Field(description="The workers that acknowledged it (every one).")


class EcPushResponse(BaseModel):
    """JSON answer of ``POST /v1/encode`` with output kind 'vllm_push': every worker named
    in ``to`` has acknowledged every item when it is sent."""

    model: str = Field(description="Checkpoint name, or 'preset:NAME'.")
    items: list[PushedEntry] = Field(description="One entry per image, in request order.")
    usage: dict[str, int] = Field(description="images, patches, tokens.")


@dataclass(frozen=True)
class PushLimits:
    """``handoff.vllm_push`` as the ranks apply it."""

    timeout_s: float
    max_in_flight: int
    max_per_destination: int

    def pusher(self) -> EcPusher:
        return EcPusher(self.timeout_s, self.max_in_flight, self.max_per_destination)


@dataclass(frozen=True)
class EcPushes:
    """A rank call's pushes: for its k-th image, ``items[k]`` are the (request index,
    uuid) of each request item it stands for; every one goes to every endpoint."""

    items: tuple[tuple[tuple[int, str], ...], ...]
    endpoints: tuple[str, ...]
    limits: PushLimits

    def only(self, positions: Sequence[int]) -> EcPushes:
        """The pushes of the call's images at ``positions`` (a call sent again)."""
        return EcPushes(tuple(self.items[k] for k in positions), self.endpoints, self.limits)


@dataclass(frozen=True)
class EcPushDestination:
    """A ``vllm_push`` request: item ``i`` is pushed as ``uuids[i]`` to every endpoint."""

    uuids: Sequence[str]
    endpoints: tuple[str, ...]
    limits: PushLimits

    def for_call(self, copies: Sequence[Sequence[int]]) -> EcPushes:
        items = tuple(tuple((i, self.uuids[i]) for i in c) for c in copies)
        return EcPushes(items, self.endpoints, self.limits)


@dataclass(frozen=True)
class Pushed:
    """One image's features as a rank pushed them (in place of the features)."""

    shape: tuple[int, int]
    dtype: str
    nbytes: int
    endpoints: tuple[str, ...]


def check_push_output(output: VllmPushOutput) -> None:
    """Distinct destinations (each is resolved and checked by ``destination``)."""
    seen: dict[str, int] = {}
    for index, address in enumerate(output.to):
        if address in seen:
            raise EncoderInputError(
                f"output.to[{index}] {address!r} repeats output.to[{seen[address]}]; list "
                "each vLLM worker once."
            )
        seen[address] = index


async def destination(
    output: VllmPushOutput, policy: ReceivePolicy, limits: PushLimits
) -> EcPushDestination:
    """Every address of ``output.to`` resolved once and checked against ``policy``
    (``ReceiveAddressRefused``, 400, before anything is encoded or connected to)."""
    checked = [await policy.check_async(address) for address in output.to]
    return EcPushDestination(output.uuids, tuple(c.endpoint for c in checked), limits)


async def push_images(
    pusher: EcPusher, sink: EcPushes, arrays: Sequence[np.ndarray | None], dtypes: Sequence[str]
) -> list[Pushed | None]:
    """Push every image (a storage array of its dtype; None: not cached, skipped) to every
    endpoint under each of its uuids, all at once within the pusher's bounds; returns
    once every push is acknowledged, or raises the first failure (the others cancelled)."""
    pushes = []
    for copies, array, dtype in zip(sink.items, arrays, dtypes, strict=True):
        if array is None:
            continue
        for index, uuid in copies:
            what = f"item {index} (uuid {uuid!r})"
            for endpoint in sink.endpoints:
                pushes.append(pusher.push(endpoint, uuid, array, dtype, what))
    tasks = [asyncio.ensure_future(p) for p in pushes]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
    return [
        None
        if array is None
        else Pushed((int(array.shape[0]), int(array.shape[1])), dtype, array.nbytes, sink.endpoints)
        for array, dtype in zip(arrays, dtypes, strict=True)
    ]


def push_answer(model: str, admitted, gathered) -> JSONResponse:
    """The metadata of every item the ranks pushed for ``admitted``."""
    output = admitted.output
    items = []
    for i, (item, pushed) in enumerate(zip(admitted.items, gathered.features, strict=True)):
        assert isinstance(pushed, Pushed), (i, type(pushed))
        tokens, hidden = pushed.shape
        items.append(
            PushedEntry(
                index=i,
                uuid=output.uuids[i],
                grid_thw=list(item.grid),
                num_tokens=tokens,
                owner_rank=gathered.owners[i],
                shape=[tokens, hidden],
                dtype=pushed.dtype,
                bytes=pushed.nbytes,
                acked_by=[e.removeprefix("tcp://") for e in pushed.endpoints],
            )
        )
    tokens = sum(entry.num_tokens for entry in items)
    usage = {"images": len(items), "patches": admitted.patches, "tokens": tokens}
    return JSONResponse(EcPushResponse(model=model, items=items, usage=usage).model_dump())


class PushMetrics:
    """Counters of one rank's pushes by destination: pushes, bytes, acknowledgements,
    busy answers and failures (``ray_kimi_encoder_ec_push_*_total``)."""

    NAMES = ("pushes", "bytes", "acks", "busy", "failures")

    def __init__(self, rank: int):
        from ray.serve import metrics

        self.rank = str(rank)
        self.counters = {
            name: metrics.Counter(
                f"kimi_encoder_ec_push_{name}",
                description=f"vllm_push output: {name} per vLLM worker, by rank.",
                tag_keys=("rank", "destination"),
            )
            for name in self.NAMES
        }
        self._seen: dict[str, dict[str, int]] = {}

    def publish(self, info: dict[str, dict[str, int]]) -> None:
        """Add what changed since the last call (``EcPusher.info()``)."""
        for endpoint, stats in info.items():
            seen = self._seen.setdefault(endpoint, dict.fromkeys(self.NAMES, 0))
            tags = {"rank": self.rank, "destination": endpoint.removeprefix("tcp://")}
            for name in self.NAMES:
                if stats[name] > seen[name]:
                    self.counters[name].inc(stats[name] - seen[name], tags=tags)
                    seen[name] = stats[name]
