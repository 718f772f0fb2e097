"""The ingress's rank and registry clients: Serve deployment handles behind
``fanout.RankClient`` and ``handoff.RegistryClient``.

The one place that knows Ray's exceptions. A call's failure is translated when it
is awaited: the errors that mean "not the request's fault, send it elsewhere"
become ``RankUnavailableError``; an error the rank raised (an undecodable image,
an encoder failure) is re-raised as itself, unwrapped from ``RayTaskError``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import (
    BackPressureError,
    DeploymentUnavailableError,
    ReplicaUnavailableError,
)
from ray.serve.handle import DeploymentHandle, DeploymentResponse

from kimi_encoder.engines.sglang import ReceiveUrlRequest
from kimi_encoder.items import EncoderItem

from .fanout import RankUnavailableError

# ActorDiedError and ActorUnavailableError are RayActorErrors.
UNAVAILABLE = (
    RayActorError,
    BackPressureError,
    DeploymentUnavailableError,
    ReplicaUnavailableError,
)


class RankCall:
    """A ``DeploymentResponse`` whose failures are translated when awaited (also one that
    sending it raised at once)."""

    def __init__(self, rank: int, send: Callable[[], DeploymentResponse]):
        self.rank = rank
        self.response: DeploymentResponse | None = None
        self.error: RankUnavailableError | None = None
        self.finished = False
        try:
            self.response = send()
        except UNAVAILABLE as exc:
            self.error = RankUnavailableError(rank, exc)

    def __await__(self) -> Any:
        if self.error is not None:
            raise self.error
        assert self.response is not None
        try:
            result = yield from self.response.__await__()
        except asyncio.CancelledError:
            raise  # our wait was cancelled: the call itself may still run
        except RayTaskError as exc:
            self.finished = True
            if isinstance(exc.cause, UNAVAILABLE):
                raise RankUnavailableError(self.rank, exc.cause) from exc
            raise exc.cause from None
        except UNAVAILABLE as exc:
            self.finished = True
            raise RankUnavailableError(self.rank, exc) from exc
        except BaseException:
            self.finished = True
            raise
        self.finished = True
        return result

    def cancel(self) -> None:
        """Cancel the call unless it has finished. Serve 2.60's ``cancel()`` on a response
        whose assignment already failed (backpressure) cancels the caller's own request."""
        if self.response is not None and not self.finished:
            self.response.cancel()


class RankHandle:
    """Rank ``rank`` as the fan-out sees it (``fanout.RankClient``)."""

    def __init__(self, rank: int, handle: DeploymentHandle):
        self.rank = rank
        self.handle = handle

    def encode(
        self,
        indices: list[int],
        items: list[EncoderItem],
        sent_at: float,
        caller: str,
        feature_dtype: str,
    ) -> RankCall:
        encode = self.handle.encode
        kwargs = {"sent_at": sent_at, "caller": caller, "feature_dtype": feature_dtype}
        return RankCall(self.rank, lambda: encode.remote(indices, items, **kwargs))

    def load(self) -> RankCall:
        return RankCall(self.rank, self.handle.load.remote)

    def info(self) -> RankCall:
        return RankCall(self.rank, self.handle.info.remote)


class RegistryCall:
    """A call to the ``HandoffRegistry`` deployment; an error the registry raised
    (``RegistryFull``, ``ReceiveTimeout``, a bad registration) is re-raised as itself.
    The replica being gone stays a Ray error (an internal error: Serve restarts it)."""

    def __init__(self, send: Callable[[], DeploymentResponse]):
        self.response = send()
        self.finished = False

    def __await__(self) -> Any:
        try:
            result = yield from self.response.__await__()
        except asyncio.CancelledError:
            raise  # our wait was cancelled: the call itself may still run
        except RayTaskError as exc:
            self.finished = True
            if isinstance(exc.cause, UNAVAILABLE):
                raise
            raise exc.cause from None
        except BaseException:
            self.finished = True
            raise
        self.finished = True
        return result

    def cancel(self) -> None:
        """Cancel the call unless it has finished (see ``RankCall.cancel``)."""
        if not self.finished:
            self.response.cancel()


class RegistryHandle:
    """The ``HandoffRegistry`` deployment as the hand-off sees it (``handoff.RegistryClient``)."""

    def __init__(self, handle: DeploymentHandle):
        self.handle = handle

    def register(self, req: ReceiveUrlRequest) -> RegistryCall:
        return RegistryCall(lambda: self.handle.register.remote(req))

    def wait_for(self, req_id: str, timeout_s: float) -> RegistryCall:
        return RegistryCall(lambda: self.handle.wait_for.remote(req_id, timeout_s))

    def info(self) -> RegistryCall:
        return RegistryCall(self.handle.info.remote)
