"""``EncodeServer``: the HTTP ingress (FastAPI). Routes and wiring only.

Admission is ``admission.py``, owner assignment ``dispatch.py``, the fan-out to the
ranks and the ordered gather ``fanout.py``, response bodies ``wire.py``, the engine
hand-off (sglang's ``/encode``, ``/scheduler_receive_url``, ``/health``; vLLM
encoder-cache files) ``handoff.py``, and every error's status and JSON envelope
``errors.py`` (routes raise, handlers answer).
"""

# No `from __future__ import annotations`: Serve's class-based FastAPI view re-signs the
# route methods and needs real annotation objects (a string `Request` became a query field).

import asyncio
import json
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from ray import serve
from ray.serve.handle import DeploymentHandle

from kimi_encoder.config import resolve_configs

from . import errors
from .admission import Admission, BodySlots
from .args import DispatchArgs, HandoffArgs, IngressArgs, ModelArgs
from .dispatch import Dispatcher
from .engine_gate import EngineGate, behind_haproxy
from .fanout import FanOut
from .handles import IngressCache, RankHandle, RegistryHandle, ScalerHandle
from .handoff import Handoff
from .heap import start_trimming
from .metrics import IngressMetrics
from .ranks import report
from .ranks.clock import LoopClock
from .ranks.follower import Follower
from .ranks.roster import Roster
from .schemas import ENCODE_OPENAPI, InfoResponse, document_request_models
from .security import ApiKey
from .timing import RANK_INFO_TIMEOUT_S
from .wire import json_response, safetensors_response

api = FastAPI(
    title="Kimi-K3 vision encoder",
    version="0.1.0",
    description="Disaggregated image encoder with vision data parallelism: each image is "
    "encoded by one owner rank, chosen by its cost and the ranks' load; features come back "
    "in request order.",
)
errors.install(api)
document_request_models(api)


# serve.ingress freezes (cloudpickles) the FastAPI app and its routes when it decorates:
# every handler, the OpenAPI hook and every name the routes use must exist by then.
@serve.ingress(api)
class EncodeServer:
    """Ingress: admission and owner assignment here, encoding on the owner ranks."""

    def __init__(
        self,
        ranks: list[DeploymentHandle],
        registry: DeploymentHandle,
        model: ModelArgs,
        ingress: IngressArgs,
        dispatch: DispatchArgs,
        handoff: HandoffArgs,
        rank_cache: bool,
        dp_min: int | None = None,
        scaler: DeploymentHandle | None = None,
    ):
        """``model`` as the ranks run it (``AppArgs.model_as_run``); ``rank_cache``:
        whether the ranks keep a feature cache (cache affinity follows it); ``scaler``
        (elastic ranks): the app's ``RankScaler``, whose decision this replica follows
        (``ranks.follower.Follower``); the first ``dp_min`` ranks always run."""
        start_trimming()
        self.model = model
        vision, preprocess, self.model_name = resolve_configs(model.checkpoint)
        self.vision = vision
        self.admission = Admission(
            vision,
            preprocess,
            ingress.limits,
            ingress.body_pace,
            model,
            vllm_ec=handoff.ec_root is not None,
        )
        self.bodies = BodySlots(ingress.max_concurrent_bodies)
        self.api_key = ApiKey.load(ingress.api_key_file)
        # sglang's routes: the key, or a keyless caller from handoff.engine_callers.networks
        callers = handoff.engine_callers.networks
        self.engine_gate = EngineGate.of(self.api_key, callers, behind_haproxy())
        timeout = dispatch.route_timeout_s
        clients = [RankHandle(rank, handle, timeout) for rank, handle in enumerate(ranks)]
        fixed = dp_min if scaler is not None else None
        self.roster = Roster(clients, dispatch, clock=LoopClock(), fixed=fixed, holds=False)
        self.dispatcher = Dispatcher(
            self.roster,
            dispatch,
            model_name=self.model_name,
            dtype=model.dtype,
            cache_enabled=rank_cache,
        )
        self.elastic = None
        if scaler is not None:
            self.elastic = Follower(self.roster, fixed, ScalerHandle(scaler))
        self.kept = (
            IngressCache(ingress.cache_bytes, ingress.cache_entries)
            if ingress.cache_bytes
            else None
        )
        self.metrics = IngressMetrics(len(ranks))
        self.roster.on_change = self._publish_live
        self.fanout = FanOut(
            self.roster,
            self.dispatcher,
            vision=vision,
            timeout_s=ingress.request_timeout_s,
            in_flight=self.metrics.dispatched,
            kept=self.kept,
        )
        self.handoff = Handoff(
            handoff,
            model.dtype,
            self.admission,
            self.fanout,
            RegistryHandle(registry),
            self.engine_gate,
        )
        self.page = (Path(__file__).parent / "static" / "index.html").read_text()

    @api.post("/v1/encode", summary="Encode images into LLM-space features", **ENCODE_OPENAPI)
    async def encode(self, request: Request) -> Response:
        """JSON (``EncodeRequest``) or multipart upload (``image`` files); see docs/api.md."""
        # Serve's proxy sets X-Request-ID (the client's, else a new one), returns it in the
        # response and carries it to the ranks' log records.
        self._scale()
        with self.metrics.trace(request.headers.get("x-request-id", "")) as trace:
            self.api_key.check(request)
            with self.bodies.take():
                admitted = await self.admission.admit(request)
            trace.admitted(admitted.items)
            to = await self.handoff.destination(admitted) if admitted.output is not None else None
            gathered = await self.fanout.run(admitted.items, admitted.feature_dtype, to)
            trace.gathered(gathered)
            if admitted.output is not None:
                return self.handoff.ec_answer(self.model_name, admitted, gathered)
            if admitted.response_format == "safetensors":
                response = safetensors_response(self.model_name, admitted, gathered)
                response.headers["X-Timings-Ms"] = json.dumps(trace.timings())
                return response
            return json_response(self.model_name, admitted, gathered, trace.timings)

    @api.get("/v1/info", response_model=InfoResponse, summary="Model, dims and each rank's state")
    async def info(self, request: Request) -> Any:
        self.api_key.check(request)
        self._scale()
        ranks = await asyncio.gather(
            *(
                report.rank_report(self.roster, r, RANK_INFO_TIMEOUT_S)
                for r in range(len(self.roster))
            )
        )
        return {
            "model": self.model_name,
            **self.vision.summary(),
            "dtype": self.model.dtype,
            "feature_dtype": self.model.feature_dtype,
            "device": self.model.device,
            "preprocess_backend": self.model.preprocess_backend,
            "dp_size": len(self.roster),
            "ranks_live": sorted(self.roster.takes_work()),
            "scaling": self.elastic.info() if self.elastic is not None else None,
            "assignment": self.dispatcher.info(),
            "failover": report.failover(self.roster),
            "ingress_cache": self.kept.info() if self.kept is not None else None,
            "handoff": await self.handoff.info(),
            "ranks": ranks,
        }

    @api.get("/v1/load", summary="In-flight requests, images, patches and bytes per rank")
    async def load(self, request: Request) -> Any:
        """What this ingress replica has dispatched to each rank and not yet got back."""
        self.api_key.check(request)
        return {"ranks": self.metrics.load()}

    @api.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def page(self) -> HTMLResponse:
        """A try-it page: drop images, see grids, owners, timings and a PCA of the features."""
        return HTMLResponse(self.page)

    @api.get("/healthz", summary="Liveness of the ingress")
    async def healthz(self) -> dict[str, str]:
        return {"status": "ok"}

    @api.post("/encode", summary="sglang 0.5.23 encoder: encode one part, push it over ZMQ")
    async def sglang_encode(self, request: Request) -> Response:
        """One part of an sglang prefill's images; answered once its frames are sent."""
        self._scale()
        with self.metrics.trace(request.headers.get("x-request-id", "")) as trace:
            await self.handoff.encode(request, trace)
        return JSONResponse(None)

    @api.post("/scheduler_receive_url", summary="sglang 0.5.23: where a prefill rank receives")
    async def scheduler_receive_url(self, request: Request) -> Response:
        await self.handoff.register(request)
        return JSONResponse(None)

    @api.get("/health", summary="sglang 0.5.23 encoder health: 200 while a rank answers")
    async def sglang_health(self, request: Request) -> dict[str, str]:
        self.engine_gate.check(request)
        await self.handoff.check_health()
        return {"status": "ok"}

    async def check_health(self) -> None:
        """Serve's periodic health check of this replica: also starts the elastic loop of
        a replica that has had no request yet."""
        self._scale()

    def _scale(self) -> None:
        """On every request: the elastic follower runs, and the live-rank gauge is current
        (a value set in the constructor is exported without the app's tags)."""
        if self.elastic is not None:
            self.elastic.start()
        self._publish_live()

    def _publish_live(self) -> None:
        """The live-rank gauge: how many ranks take work now (elastic ranks: the app's
        scaler publishes it, as decided)."""
        if self.elastic is None:
            self.metrics.ranks_live(len(self.roster.takes_work()))
