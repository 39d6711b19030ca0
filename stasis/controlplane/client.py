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

from stasis.errors import NotFoundError, PermissionDeniedError, StasisError, UsageError


class ControlPlaneUnreachable(StasisError):
    """Nothing (or no HTTP) answers at the control plane's URL."""


class Unauthorized(PermissionDeniedError):
    """401: the token is unknown, revoked or expired (a node's credential reset by an admin)."""


class Conflict(UsageError):
    """409: at odds with what the control plane holds (a node joined already, a lease no
    longer held, a job id that several nodes report)."""


_BY_STATUS: dict[int, type[StasisError]] = {
    400: UsageError,
    401: Unauthorized,
    403: PermissionDeniedError,
    404: NotFoundError,
    409: Conflict,
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
            try:
                message = str(json.loads(e.read()).get("error"))
            except (ValueError, AttributeError):
                message = f"{e.code} {e.reason}"
            raise _BY_STATUS.get(e.code, StasisError)(message) from None
        except (urllib.error.URLError, OSError, ValueError) as e:
            why = getattr(e, "reason", e)
            raise ControlPlaneUnreachable(
                f"cannot reach the control plane at {self.url} "
                f"({why}): is it running? (STASIS_CONTROLPLANE_URL)"
            ) from None
