"""The ingress's request timeout around the fan-out to the ranks (HTTP 504)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any


class RequestTimeoutError(TimeoutError):
    """The ranks did not answer within ``request_timeout_s`` (HTTP 504)."""

    def __init__(self, timeout_s: float):
        super().__init__(
            f"the encoder ranks did not answer within request_timeout_s={timeout_s:g} s; the "
            "request was cancelled. Send fewer or smaller images per request, or retry later."
        )


async def settle_within(
    calls: Sequence[Any], timeout_s: float, request_timeout_s: float | None = None
) -> list[Any]:
    """Each call's result or exception (Serve ``DeploymentResponse``s), in order, within
    ``timeout_s`` (what is left of the request's ``request_timeout_s``).

    One failed call does not cancel the others: the ingress sends a dead rank's
    images to another rank and keeps the rest (deployments/failover.py). On
    timeout every call is cancelled with ``call.cancel()`` (awaiting a
    ``DeploymentResponse`` and abandoning it would leave it running and holding
    its rank's queue slot) and ``RequestTimeoutError`` is raised; when the
    request itself is cancelled (the client went away) the calls are cancelled too.
    """
    try:
        return await asyncio.wait_for(
            asyncio.gather(*calls, return_exceptions=True), max(timeout_s, 0.0)
        )
    except asyncio.TimeoutError:
        _cancel_all(calls)
        raise RequestTimeoutError(request_timeout_s or timeout_s) from None
    except BaseException:
        _cancel_all(calls)
        raise


def _cancel_all(calls: Sequence[Any]) -> None:
    for call in calls:
        call.cancel()  # no-op for a call that already finished
