"""The control plane's API as the admin CLI and the node daemons call it (blocking, stdlib HTTP:
a call every few seconds needs no more)."""

from __future__ import annotations

import ipaddress
import json
import ssl
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from stasis.errors import (
    ConflictError,
    ControlPlaneUnreachableError,
    NotFoundError,
    PermissionDeniedError,
    StasisError,
    UnauthenticatedError,
    UsageError,
    error_from_wire,
)

# What a status says when the body names no class of stasis.errors (a proxy's own page).
_BY_STATUS: dict[int, type[StasisError]] = {
    400: UsageError,
    401: UnauthenticatedError,
    403: PermissionDeniedError,
    404: NotFoundError,
    409: ConflictError,
    413: UsageError,
}


def loopback(host: str) -> bool:
    """Whether `host` names this host's loopback: localhost, 127.0.0.0/8 or ::1. A name is
    not resolved: only `localhost` itself counts (a resolver can be told anything)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_url(url: str, allow_plain_http: bool) -> None:
    """Refuse (UsageError, one line) a control plane URL that would send a token in the clear
    across a network: http:// to a host other than loopback, unless the site allows it."""
    if not url.startswith(("http://", "https://")):
        raise UsageError(f"control plane URL {url!r} is not http:// or https://")
    host = urllib.parse.urlsplit(url).hostname or ""
    if url.startswith("http://") and not loopback(host) and not allow_plain_http:
        raise UsageError(
            f"refused control plane URL {url}: plain http:// to {host or '?'}, "
            "not this host's loopback, would send the token in the clear; use "
            "https://, or allow it with controlplane_allow_plain_http = true "
            "(STASIS_CONTROLPLANE_ALLOW_PLAIN_HTTP=1)"
        )


class ControlPlaneClient:
    def __init__(
        self, url: str, token: str, timeout_s: float = 10.0, allow_plain_http: bool = False
    ) -> None:
        if not url:
            raise UsageError(
                "no control plane: set STASIS_CONTROLPLANE_URL (or "
                "controlplane_url in the config)"
            )
        check_url(url, allow_plain_http)
        self.url = url.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s
        self._ssl = ssl.create_default_context() if url.startswith("https://") else None

    def request(
        self, method: str, path: str, body: Any = None, timeout_s: float | None = None
    ) -> Any:
        """`timeout_s`: this request's own bound (the client's by default)."""
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(
                req, timeout=timeout_s or self.timeout_s, context=self._ssl
            ) as r:
                return json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            raise _answered(e) from None
        except (urllib.error.URLError, OSError, ValueError) as e:
            why = getattr(e, "reason", e)
            raise ControlPlaneUnreachableError(
                f"cannot reach the control plane at {self.url} "
                f"({why}): is it running? (STASIS_CONTROLPLANE_URL)"
            ) from None


def _answered(e: urllib.error.HTTPError) -> StasisError:
    """The error the control plane answered, as the class it named (stasis.errors)."""
    try:
        said = json.loads(e.read()).get("error")
    except (ValueError, AttributeError):
        said = None
    if isinstance(said, dict) and isinstance(said.get("message"), str):
        error = error_from_wire(str(said.get("type")), said["message"])
        if type(error) is StasisError:  # a class this side does not know: the status's
            error = _BY_STATUS.get(e.code, StasisError)(said["message"])
        return error
    return _BY_STATUS.get(e.code, StasisError)(f"{e.code} {e.reason}")
