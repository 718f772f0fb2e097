"""Hand-off to LLM engines in encoder/prefill/decode disaggregation.

``sglang`` speaks sglang's encode/prefill split (the ``/encode`` and
``/scheduler_receive_url`` requests, the two ZMQ frames); ``vllm`` writes
vLLM's encoder-cache files; ``media`` turns image references into bytes under
a fetch policy; ``transport`` pushes frames over ZMQ. None of them imports an
engine: the protocols are written down here, and ``tests/interop`` checks them
against the engines' own code. ``docs/epd.md`` cites where each fact comes from.
"""
