"""``handoff``: the engine hand-off."""

from __future__ import annotations

from pathlib import PurePath

from pydantic import Field, field_validator

from kimi_encoder.engines.transport import DEFAULT_RECEIVE_NETWORKS, ReceivePolicy, parse_networks

from .base import Section, part
from .model import ImageUrlOptions


class VllmPushArgs(Section):
    """Output kind 'vllm_push': each rank pushes its images' features to the vLLM
    workers a request names, and waits for their acknowledgements (docs/epd.md)."""

    ack_timeout_s: float = Field(
        10.0,
        gt=0,
        description="Longest one item's push to one vLLM worker may take, from waiting for a "
        "push slot to the worker's acknowledgement; past it the request fails with 503 naming "
        "the item and the worker.",
    )
    max_in_flight: int = Field(
        64,
        ge=1,
        description="Pushes one rank has unacknowledged at once; a push waits for a slot (at "
        "most ack_timeout_s, then 503 with Retry-After).",
    )
    max_in_flight_per_destination: int = Field(
        16,
        ge=1,
        description="Pushes one rank has unacknowledged at once to one vLLM worker (the same "
        "wait, the same 503).",
    )


class EngineCallerArgs(Section):
    """Who may call the engines' routes without the API key (docs/api.md, Security)."""

    # Loopback only: a user widens it knowingly.
    networks: list[str] = Field(
        default_factory=lambda: ["127.0.0.0/8", "::1/128"],
        description="Networks (CIDR) from which, with an API key configured, a caller without "
        "the key is served on the engines' routes (sglang's /encode, /scheduler_receive_url, "
        "/health); anyone else gets 401 before the body is read. /v1/* always needs the key. "
        "The caller's address is the one Serve's proxy saw; behind Serve's HAProxy ingress, "
        "which passes no caller address, every keyless call is refused.",
    )

    @field_validator("networks")
    @classmethod
    def _networks(cls, value: list[str]) -> list[str]:
        try:
            parse_networks(value)
        except ValueError as exc:
            where = "handoff.engine_callers.networks entry"
            raise ValueError(str(exc).replace("receive network", where, 1)) from None
        return value


class HandoffArgs(Section):
    """The engine hand-off: sglang's /encode parts and vLLM's encoder-cache files."""

    image_urls: ImageUrlOptions = part(
        ImageUrlOptions,
        "Fetch policy of http(s) image URLs in sglang /encode parts (off by default).",
    )
    ec_root: str | None = Field(
        None,
        description="Absolute directory of vLLM's encoder cache (the consumer's "
        "ECExampleConnector shared_storage_path, on storage it shares with the ingress and "
        "the ranks, which write the files); "
        "/v1/encode writes there when a request asks for output kind 'vllm_ec'. None: "
        "that output is refused.",
    )
    # sglang's prefill gives up on a part after SGLANG_ENCODER_RECV_TIMEOUT (180 s).
    wait_s: float = Field(
        30.0,
        gt=0,
        description="Longest an /encode part waits for its scheduler ranks' "
        "/scheduler_receive_url addresses (zmq_to_scheduler); the part's request timeout "
        "(ingress.request_timeout_s) caps it.",
    )
    send_timeout_s: float = Field(
        10.0,
        gt=0,
        description="Longest a push of a part's frames to one prefill address may wait (a "
        "receiver that is gone or not reading costs this once).",
    )
    max_pending: int = Field(
        4096,
        ge=1,
        description="Parts whose receive addresses are awaited or held at once, over all "
        "ingress replicas; past it /encode and /scheduler_receive_url answer 503.",
    )
    address_ttl_s: float = Field(
        180.0,
        gt=0,
        description="Registered receive addresses whose /encode never came are forgotten "
        "after this many seconds.",
    )
    # sglang sends no API key: whoever reaches /encode names where the ingress connects.
    receive_networks: list[str] = Field(
        default_factory=lambda: list(DEFAULT_RECEIVE_NETWORKS),
        description="Networks (CIDR) that sglang's receive addresses must resolve into: an "
        "/encode part's prefill_host:embedding_port, each /scheduler_receive_url address. "
        "Any other address is refused (400) and nothing connects to it, not even for an "
        "error frame. Default: loopback and the private ranges. Link-local "
        "(169.254.0.0/16, fe80::/10) is left out, as cloud metadata services live there "
        "and a prefill listens on a routable address; list it, or a public network, to "
        "push there.",
    )

    vllm_push: VllmPushArgs = part(
        VllmPushArgs, "Output kind 'vllm_push': acknowledgement timeout and push bounds."
    )
    engine_callers: EngineCallerArgs = part(
        EngineCallerArgs, "Networks whose keyless calls the engines' routes serve."
    )

    @field_validator("receive_networks")
    @classmethod
    def _networks(cls, value: list[str]) -> list[str]:
        parse_networks(value)
        return value

    def receive_policy(self) -> ReceivePolicy:
        return ReceivePolicy.from_cidrs(self.receive_networks, setting="handoff.receive_networks")

    @field_validator("ec_root")
    @classmethod
    def _absolute_ec_root(cls, value: str | None) -> str | None:
        if value is not None and not PurePath(value).is_absolute():
            raise ValueError(
                f"ec_root must be an absolute directory, got {value!r}; give the consumer's "
                "shared_storage_path as it is mounted on the ingress's node."
            )
        return value
