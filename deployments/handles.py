"""The ingress's rank and registry clients: Serve deployment handles behind
``roster.RankClient`` and ``handoff.RegistryClient``.

The one place that knows Ray's exceptions and Serve's routing. A call first asks
Serve's router for a replica of the rank (``choose_replica``). A dead rank's
router holds new calls until a replacement has started (seconds on a CPU,
minutes with a real checkpoint); a starved machine routes slowly too, and the
two look the same from here. So an encode call keeps routing (``routed`` says
whether a replica took it) and the fan-out hedges its images to the other ranks
once it has waited ``dispatch.route_timeout_s``; a load poll gives up after that
long and says the rank is *slow* (any answer brings it back), never *failed*.
Whether a slow rank's last replica still exists is asked of Ray's registry of
named actors (``replica_alive``): a dead rank is then told from a starved one.
The chosen replica's id travels with the answer or the error, so the ingress
knows which process of the rank it heard from.

A call's failure is translated when it is awaited: the errors that mean "not the
request's doing, send it elsewhere" become ``RankUnavailableError``; an error
the rank raised (an undecodable image, an encoder failure) is re-raised as
itself, unwrapped from ``RayTaskError``.

The bytes of a call: images the fan-out expects the rank's cache to hold go by
digest (``EncoderItem.by_digest``), and the ones the rank answers missing are
sent again with their bytes by the same ``RankCall``. Features a rank keeps in
the object store come back as refs and are read in place before the answer is
handed to the fan-out (``_read_stored``); a ref whose owner died is the rank's
failure (``ObjectLostError``: unavailable, re-dispatched). The refs stay in the answer
to tell ``IngressCache`` which arrays lie in the object store: it keeps those, so that a
repeated image needs no rank call.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
from ray import serve
from ray.exceptions import ObjectLostError, RayActorError, RayTaskError
from ray.serve._private.common import DeploymentID, ReplicaID  # ReplicaID: public alpha
from ray.serve.exceptions import (
    BackPressureError,
    DeploymentUnavailableError,
    ReplicaUnavailableError,
)
from ray.serve.handle import DeploymentHandle, DeploymentResponse

from kimi_encoder.cache import MAX_ENTRIES, FeatureCache
from kimi_encoder.engines.sglang import ReceiveUrlRequest

from .ranks.calls import EncodeCall, RankUnavailableError
from .ranks.decision import IngressView
from .ranks.records import RankReply
from .ranks.scaler import Replicas
from .sinks import PartPush
from .timing import LOOKUP_TIMEOUT_S, SCALER_ANSWER_S

log = logging.getLogger("ray.serve")

SERVE_NAMESPACE = "serve"  # where Serve registers its replicas' actors by name

# ActorDiedError and ActorUnavailableError are RayActorErrors; OwnerDiedError (a rank's
# features in the object store, gone with the rank) is an ObjectLostError.
UNAVAILABLE = (
    RayActorError,
    ObjectLostError,
    BackPressureError,
    DeploymentUnavailableError,
    ReplicaUnavailableError,
)


class RankCall:
    """One call to a rank, running as a task from creation: route, dispatch, await.
    ``replica`` is the replica that took it (None until routed). With ``route_timeout_s``
    a call no replica took in that time fails as a *slow* ``RankUnavailableError``;
    without, it routes until it is cancelled. ``full_is_slow``: a rank whose queue is full
    (Serve's back-pressure) is busy, a *slow* error too (a load poll); otherwise the
    call's work goes elsewhere at once (an encode call)."""

    def __init__(
        self,
        rank: int,
        handle: DeploymentHandle,
        route_timeout_s: float | None,
        *args,
        refill: Refill | None = None,
        full_is_slow: bool = False,
        **kw,
    ):
        self.rank = rank
        self.replica: str | None = None
        self._refill = refill
        self._full_is_slow = full_is_slow
        self._task = asyncio.ensure_future(self._run(handle, route_timeout_s, args, kw))

    def __await__(self) -> Any:
        return self._task.__await__()

    @property
    def routed(self) -> bool:
        return self.replica is not None

    def cancel(self) -> None:
        """Cancel the call (a no-op once it has finished)."""
        self._task.cancel()

    async def _run(self, handle: DeploymentHandle, timeout_s: float | None, args, kwargs) -> Any:
        result = await self._once(handle, timeout_s, args, kwargs)
        missing = result.missing if isinstance(result, RankReply) else None
        if not missing:
            return result
        # Sent by digest, evicted since (or the rank was replaced): once more, with bytes.
        assert self._refill is not None, f"rank {self.rank} answered missing images unasked"
        again_args, again_kwargs = self._refill(missing)
        again = await self._once(handle, None, again_args, again_kwargs)
        return _refilled(result, missing, again)

    async def _once(self, handle: DeploymentHandle, timeout_s: float | None, args, kwargs) -> Any:
        chooser = handle.choose_replica(*args, **kwargs)
        try:
            selection = await asyncio.wait_for(chooser.__aenter__(), timeout_s)
        except asyncio.TimeoutError:
            # Dead, starting, full or starved of CPU: alive until proven otherwise.
            raise self._unavailable(
                f"no replica took the call within {timeout_s:g} s (the rank died, is "
                "starting, its queue is full or the machine is starved)",
                slow=True,
            ) from None
        except UNAVAILABLE as exc:
            busy = self._full_is_slow and isinstance(exc, BackPressureError)
            raise self._unavailable(exc, slow=busy) from exc
        self.replica = selection.replica_id
        failure: BaseException | None = None
        try:
            response = handle.dispatch(selection, *args, **kwargs)
            try:
                result = await response
            except asyncio.CancelledError:
                response.cancel()  # the request went away: so does the rank's call
                raise
            return await _read_stored(result)
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

    def _unavailable(self, cause: BaseException | str, slow: bool = False) -> RankUnavailableError:
        return RankUnavailableError(self.rank, cause, replica=self.replica, slow=slow)


# Given the positions of a call's images the rank answered missing: the arguments and
# keyword arguments of a call that sends them again with their bytes.
Refill = Callable[[list[int]], tuple[tuple, dict]]


def _refilled(first: RankReply, missing: list[int], again: RankReply) -> RankReply:
    """``first``'s answer with its missing images' features taken from ``again``."""
    assert not again.missing, f"images sent with their bytes came back missing: {again}"
    features = list(first.features)
    refs = list(first.refs or [None] * len(features))
    again_refs = again.refs or [None] * len(again.features)
    for position, array, ref in zip(missing, again.features, again_refs, strict=True):
        features[position], refs[position] = array, ref
    encode_ms = first.encode_ms + again.encode_ms
    return again.replace(features=features, refs=refs, missing=[], encode_ms=encode_ms)


async def _read_stored(result: Any) -> Any:
    """An encode answer with its features read in place: a rank with its cache on answers
    refs to features it wrote into the object store once (``stored.StoredFeatures``);
    each becomes the read-only array the object store holds (no copy). The refs stay in
    the answer's ``refs`` (None for an array sent as it is), for ``IngressCache``."""
    if not isinstance(result, RankReply):
        return result
    if not any(isinstance(f, ray.ObjectRef) for f in result.features):
        return result
    arrays = await asyncio.gather(*(_read(f) for f in result.features))
    refs = [f if isinstance(f, ray.ObjectRef) else None for f in result.features]
    return result.replace(features=list(arrays), refs=refs)


async def _read(feature: Any) -> Any:
    return await feature if isinstance(feature, ray.ObjectRef) else feature


@dataclass(frozen=True)
class _Kept:
    features: np.ndarray  # read-only, as it lies in the object store
    rank: int  # the rank that encoded them

    @property
    def nbytes(self) -> int:  # what the cache's bound counts
        return self.features.nbytes


class IngressCache:
    """The ranks' cached features as this ingress replica has seen them answered: an LRU,
    bounded in feature bytes (``ingress.cache_bytes``), of the read-only arrays those
    answers were read into, each a view of its object in the store
    (``fanout.KeptFeatures``). A repeated image is answered from the array held here,
    without a rank call and without reading its ref again: the rank calls of a
    request of hits cost the ingress about as much CPU as the rest of the request,
    and awaiting the refs again costs CPU too, where a held array costs nothing to
    hand out (docs/api.md, "Measurements behind the code").

    A held array keeps its object in the store, mapped in this process, after the
    rank's own cache has dropped it and after the rank has died: features never
    change, so they stay right to answer with (the store's bound counts them:
    ``rank.check_cache_fits``)."""

    def __init__(self, max_bytes: int, max_entries: int = MAX_ENTRIES):
        self.entries = FeatureCache(max_bytes, max_entries)

    def lookup(self, keys: Sequence[str]) -> dict[int, tuple[np.ndarray, int]]:
        return {
            i: (kept.features, kept.rank)
            for i, key in enumerate(keys)
            if (kept := self.entries.get(key)) is not None
        }

    def keep(self, key: str, features: np.ndarray, rank: int) -> None:
        self.entries.put(key, _Kept(features, rank))

    def info(self) -> dict[str, Any]:
        stats = self.entries.stats
        return {
            "max_bytes": self.entries.max_bytes,
            "max_entries": self.entries.max_entries,
            **vars(stats),
        }


class RankHandle:
    """Rank ``rank`` as the ingress sees it (``roster.RankClient``). Encode and info
    calls route until cancelled (the fan-out hedges an unrouted encode call; the info
    page bounds its wait); a load poll gives up routing after ``route_timeout_s``."""

    def __init__(self, rank: int, handle: DeploymentHandle, route_timeout_s: float):
        self.rank = rank
        self.handle = handle
        self.route_timeout_s = route_timeout_s

    def encode(self, call: EncodeCall) -> RankCall:
        """Images the rank's cache is expected to hold (``call.held``) go by digest,
        without their file bytes, which as call arguments cost Ray's object store CPU on
        every call (docs/api.md, "Measurements behind the code"); any the rank no longer
        holds are sent again with their bytes in a second call, within the same
        ``RankCall``."""
        items = call.items
        held = call.held or [False] * len(items)
        held = [bool(h) and i.can_go_by_digest for h, i in zip(held, items, strict=True)]
        if not any(held):
            return self._call("encode", None, dataclasses.replace(call, held=()))
        sent = [item.by_digest() if h else item for h, item in zip(held, items, strict=True)]

        def refill(missing: list[int]) -> tuple[tuple, dict]:
            return (dataclasses.replace(call.only(missing), sent_at=time.time()),), {}

        return self._call("encode", None, dataclasses.replace(call, items=sent), refill=refill)

    def push(self, part: PartPush, stored: Sequence[Any]) -> RankCall:
        """Have the rank push ``part`` (``EncoderRank.push``); ``stored`` are the refs the
        ranks kept of its images' features, passed on unread."""
        return self._call("push", None, part, list(stored))

    def load(self) -> RankCall:
        return self._call("load", self.route_timeout_s, full_is_slow=True)

    def hold(self, seconds: float) -> RankCall:
        return self._call("hold", None, seconds)

    def wake(self) -> RankCall:
        """A load call that routes until a replica takes it: Serve starts a replica of a
        rank scaled to zero for a call waiting at its handle."""
        return self._call("load", None)

    def info(self) -> RankCall:
        return self._call("info", None)

    async def replica_alive(self, replica: str) -> bool:
        """Whether ``replica`` (a replica id of this rank, as ``choose_replica`` gave it)
        still has its actor registered: Serve names each replica's actor, and a dead
        one's name is released. Unknown (a slow or failing lookup) counts as alive."""
        deployment = DeploymentID(self.handle.deployment_name, self.handle.app_name)
        name = ReplicaID(replica, deployment).to_full_id_str()
        lookup = asyncio.to_thread(ray.get_actor, name, SERVE_NAMESPACE)
        try:
            await asyncio.wait_for(lookup, LOOKUP_TIMEOUT_S)
        except ValueError:  # no actor of that name: the replica has died
            return False
        except Exception as exc:  # noqa: BLE001 - the lookup says nothing: assume alive
            log.info("rank %d: could not look up replica %s (%r)", self.rank, replica, exc)
        return True

    def _call(self, method: str, route_timeout_s: float | None, *args, **kwargs) -> RankCall:
        handle = self.handle.options(method_name=method)
        return RankCall(self.rank, handle, route_timeout_s, *args, **kwargs)


class ServeDirectory:
    """Serve's own view of the ranks' replicas (``scaling.Directory``): how many of each
    rank deployment's replicas run, and the deployment's status message (why a replica
    does not start: no resources for it, a constructor that fails). Read from
    ``serve.status()`` on a thread (it waits on the controller)."""

    def __init__(self, handles: Sequence[DeploymentHandle]):
        self.app = handles[0].app_name if handles else ""
        self.names = [h.deployment_name for h in handles]

    async def replicas(self) -> dict[int, Replicas]:
        status = await asyncio.to_thread(serve.status)
        app = status.applications.get(self.app)
        if app is None:
            return {}
        out = {}
        for rank, name in enumerate(self.names):
            if (deployment := app.deployments.get(name)) is not None:
                running = deployment.replica_states.get("RUNNING", 0)  # a str enum's keys
                out[rank] = Replicas(running, deployment.message)
        return out


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


class ScalerHandle:
    """The app's ``RankScaler`` deployment (``scaling.ScalerClient``): its decision."""

    def __init__(self, handle: DeploymentHandle):
        self.handle = handle

    async def decision(self, instance: str, seen: int, view: IngressView, wait_s: float) -> Any:
        response = self.handle.decision.remote(instance, seen, view, wait_s)
        try:
            return await asyncio.wait_for(response, wait_s + SCALER_ANSWER_S)
        except asyncio.TimeoutError:
            response.cancel()
            raise
