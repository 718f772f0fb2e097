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


async def gather_within(calls: Sequence[Any], timeout_s: float) -> list[Any]:
    """Results of ``calls`` (Serve ``DeploymentResponse``s), in order, within ``timeout_s``.

    On timeout every call is cancelled with ``call.cancel()`` (awaiting a
    ``DeploymentResponse`` and abandoning it would leave it running and holding
    its rank's queue slot) and ``RequestTimeoutError`` is raised. Any other
    failure cancels the calls still running too, then propagates.
    """
    try:
        return await asyncio.wait_for(asyncio.gather(*calls), timeout_s)
    except asyncio.TimeoutError:
        _cancel_all(calls)
        raise RequestTimeoutError(timeout_s) from None
    except BaseException:
        _cancel_all(calls)
        raise


def _cancel_all(calls: Sequence[Any]) -> None:
    for call in calls:
        call.cancel()  # no-op for a call that already finished
