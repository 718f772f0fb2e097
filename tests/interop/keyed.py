"""The API key of the interop service: /v1/* needs it, the engines' routes serve the
engines keyless from loopback (handoff.engine_callers.networks, its default)."""

KEY = "interop-key-3c9d41e07b"
AUTH = {"authorization": f"Bearer {KEY}"}
