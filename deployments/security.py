"""Optional API key of the encode server: ``Authorization: Bearer <key>``.

The key comes from the environment variable ``KIMI_ENCODER_API_KEY`` or from
the file named by ``ingress.api_key_file`` (one of them, read in the ingress
process), never from the config itself, so it is not in Serve's stored config,
the dashboard or a log. Only a SHA-256 digest is kept; requests are compared
in constant time. ``/healthz`` and the page at ``/`` stay open.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping
from pathlib import Path

from starlette.requests import Request

ENV_VAR = "KIMI_ENCODER_API_KEY"


class UnauthorizedError(Exception):
    """Missing or wrong API key (HTTP 401)."""

    def __init__(self):
        super().__init__("missing or wrong API key; send the header 'Authorization: Bearer <key>'.")


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


class ApiKey:
    """The configured key (as a digest), or none: then every request is allowed."""

    def __init__(self, key: str | None):
        self._digest = None if key is None else _digest(key)

    def __repr__(self) -> str:  # never the key itself
        return f"ApiKey(required={self.required})"

    @property
    def required(self) -> bool:
        return self._digest is not None

    @classmethod
    def load(cls, key_file: str | None, environ: Mapping[str, str] = os.environ) -> ApiKey:
        """The key from ``$KIMI_ENCODER_API_KEY`` or ``key_file``, whitespace stripped."""
        from_env = environ.get(ENV_VAR)
        if from_env is not None and key_file is not None:
            raise ValueError(
                f"both ${ENV_VAR} and api_key_file={key_file!r} are set; configure the API key "
                "in one place only."
            )
        if key_file is not None:
            try:
                key = Path(key_file).read_text(encoding="utf-8").strip()
            except OSError as exc:
                raise ValueError(
                    f"cannot read api_key_file={key_file!r} ({type(exc).__name__}); it must be "
                    "readable on the node that runs the ingress."
                ) from None
            source = f"api_key_file={key_file!r}"
        elif from_env is not None:
            key, source = from_env.strip(), f"${ENV_VAR}"
        else:
            return cls(None)
        if not key:
            raise ValueError(f"the API key in {source} is empty; put the key there or unset it.")
        return cls(key)

    def allows(self, authorization: str | None) -> bool:
        """Whether an ``Authorization`` header value carries the key (constant-time compare)."""
        if self._digest is None:
            return True
        scheme, _, token = (authorization or "").partition(" ")
        given = _digest(token.strip()) if scheme.lower() == "bearer" else b""
        return hmac.compare_digest(given, self._digest)

    def check(self, request: Request) -> None:
        """Raise ``UnauthorizedError`` unless the request carries the key."""
        if not self.allows(request.headers.get("authorization")):
            raise UnauthorizedError()
