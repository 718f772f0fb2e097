"""The service's fixed times, each with why it is what it is; every other module reads
them from here. The ones an operator may need to change are settings instead, with their
descriptions: ``dispatch.probe_timeout_s``, ``dispatch.report_answer_s`` and
``dispatch.report_outdated_s``; ``scaling.tick_s``, ``scaling.hold_s``,
``scaling.report_fresh_s`` and ``scaling.report_stale_s`` (deployments/args/)."""

# The ingress's loop clock (ranks/clock.py) ticks this often: a stall of its event loop
# longer than a tick stops the clock, so no rank is judged late for it.
LOOP_TICK_S = 0.05
# A request whose ranks are all down looks for one back this often (fanout.py).
RECHECK_S = 0.1
# /v1/info waits this long for each rank's own report; a sick rank is reported as such.
RANK_INFO_TIMEOUT_S = 10.0
# The hand-off's /health: sglang's bootstrap server probes it with a 2 s timeout.
HEALTH_TIMEOUT_S = 1.0
# Ray's registry of named actors slower than this says nothing about a slow rank's
# replica (handles.py): it counts as alive.
LOOKUP_TIMEOUT_S = 2.0

# Elastic ranks (ranks/scaler.py, ranks/follower.py).
SYNC_S = 1.0  # Serve's view of the ranks' replicas is read this often
DOWN_SHARE = 0.5  # one rank fewer must still be this far under the target: no flapping
FOLLOW_WAIT_S = 1.0  # a follower's ask waits this long for a change: its view's refresh
FOLLOW_RETRY_S = 0.5  # a follower asks again this soon after an ask that failed
SCALER_ANSWER_S = 5.0  # past its wait, a scaler that has not answered is being replaced
# Serve's autoscaling of an elastic rank: its defaults (10 s pushes, a 30 s window) would
# park an idle rank 40 s late (args/scaling.py).
METRICS_INTERVAL_S = 1.0
LOOK_BACK_S = 5.0
