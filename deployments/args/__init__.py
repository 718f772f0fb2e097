"""``AppArgs``: the builder arguments of ``build_app`` (the ``args:`` block of a config),
grouped by the component that reads them.

``model`` (the checkpoint and its dtypes: ranks and ingress), ``dp_size``, ``ranks``
(``EncoderRank`` and its ``RankBatcher``), ``ingress`` (``EncodeServer``, its
``Admission``), ``dispatch`` (owner assignment and failover at the ingress:
``Dispatcher``, ``FanOut``, ``RankHealth``), ``handoff`` (the engine hand-off:
``Handoff``, ``HandoffRegistry``) and ``glibc_tunables`` (every replica process).
``build_app`` hands each component its own section and the few values derived from
others (the model as the ranks run it, the object-store share of the ingress cache).
The runtime imports these models; this module imports no runtime code.
"""

from .app import MOVED, AppArgs, nested
from .base import GLIBC_TUNABLES, TUNABLE, ActorOptions, Section, ServeOptions, part
from .dispatch import DispatchArgs
from .handoff import EngineCallerArgs, HandoffArgs, VllmPushArgs
from .ingress import BodyPace, IngressArgs, RequestLimits
from .model import ImageUrlOptions, ModelArgs
from .ranks import BatchingArgs, RankArgs
from .scaling import DpRange, ScalingArgs

__all__ = [
    "GLIBC_TUNABLES",
    "MOVED",
    "TUNABLE",
    "ActorOptions",
    "AppArgs",
    "BatchingArgs",
    "BodyPace",
    "DispatchArgs",
    "DpRange",
    "EngineCallerArgs",
    "HandoffArgs",
    "ImageUrlOptions",
    "IngressArgs",
    "ModelArgs",
    "RankArgs",
    "RequestLimits",
    "ScalingArgs",
    "Section",
    "ServeOptions",
    "VllmPushArgs",
    "nested",
    "part",
]
