"""The ingress's rank and registry clients: Serve deployment handles behind
``fanout.RankClient`` and ``handoff.RegistryClient``.

The one place that knows Ray's exceptions and Serve's routing. A call first asks
Serve's router for a replica of the rank (``choose_replica``), within
``route_timeout_s``: a dead rank's router otherwise holds new calls until a
replacement has started (seconds on a CPU, minutes with a real checkpoint), so a
call that finds no replica in time fails as unavailable and its images go to the
other ranks at once. The chosen replica's id travels with the answer or the
error, so the ingress knows which process of the rank it heard from.

A call's failure is translated when it is awaited: the errors that mean "not the
request's fault, send it elsewhere" become ``RankUnavailableError``; an error
the rank raised (an undecodable image, an encoder failure) is re-raised as
itself, unwrapped from ``RayTaskError``.
"""

from __future__ import annotations

import asyncio
import time
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
    """One call to a rank, running as a task from creation: route (bounded), dispatch,
    await. ``replica`` is the replica that took it (None until routed);
    ``started`` its ``time.monotonic()`` at creation."""

    def __init__(self, rank: int, handle: DeploymentHandle, route_timeout_s: float, *args, **kw):
        self.rank = rank
        self.replica: str | None = None
        self.started = time.monotonic()
        self._task = asyncio.ensure_future(self._run(handle, route_timeout_s, args, kw))

    def __await__(self) -> Any:
        return self._task.__await__()

    def cancel(self) -> None:
        """Cancel the call (a no-op once it has finished)."""
        self._task.cancel()

    async def _run(self, handle: DeploymentHandle, timeout_s: float, args, kwargs) -> Any:
        chooser = handle.choose_replica(*args, **kwargs)
        try:
            selection = await asyncio.wait_for(chooser.__aenter__(), timeout_s)
        except asyncio.TimeoutError:
            raise self._unavailable(
                f"no replica took the call within {timeout_s:g} s (the rank died, is "
                "starting or its queue is full)"
            ) from None
        except UNAVAILABLE as exc:
            raise self._unavailable(exc) from exc
        self.replica = selection.replica_id
        failure: BaseException | None = None
        try:
            response = handle.dispatch(selection, *args, **kwargs)
            try:
                return await response
            except asyncio.CancelledError:
                response.cancel()  # the request went away: so does the rank's call
                raise
        except RayTaskError as exc:
            failure = exc
            if isinstance(exc.cause, UNAVAILABLE):
                raise self._unavailable(exc.cause) from exc
            raise exc.cause from None
        except UNAVAILABLE as exc:
            failure = exc
            raise self._unavailable(exc) from exc
        except BaseException as exc:
            failure = exc
            raise
        finally:
            exc_info = (type(failure), failure, None) if failure else (None, None, None)
            await chooser.__aexit__(*exc_info)

    def _unavailable(self, cause: BaseException | str) -> RankUnavailableError:
        return RankUnavailableError(self.rank, cause, replica=self.replica, started=self.started)


class RankHandle:
    """Rank ``rank`` as the fan-out sees it (``fanout.RankClient``)."""

    def __init__(self, rank: int, handle: DeploymentHandle, route_timeout_s: float):
        self.rank = rank
        self.handle = handle
        self.route_timeout_s = route_timeout_s

    def encode(
        self,
        indices: list[int],
        items: list[EncoderItem],
        sent_at: float,
        caller: str,
        feature_dtype: str,
    ) -> RankCall:
        kwargs = {"sent_at": sent_at, "caller": caller, "feature_dtype": feature_dtype}
        return self._call("encode", indices, items, **kwargs)

    def load(self) -> RankCall:
        return self._call("load")

    def info(self) -> RankCall:
        return self._call("info")

    def _call(self, method: str, *args, **kwargs) -> RankCall:
        handle = self.handle.options(method_name=method)
        return RankCall(self.rank, handle, self.route_timeout_s, *args, **kwargs)


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
