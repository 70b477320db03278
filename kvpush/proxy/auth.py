"""Who may use what: the clients' API key on /v1/*, the admin token on /admin/*.

Each check answers the refusal to send (vLLM-shaped JSON), or None when the request may
pass. Secrets are compared in constant time.
"""

from __future__ import annotations

import hmac

from aiohttp import web

from kvpush.proxy.errors import error_response


def bearer_matches(header: str, secret: str) -> bool:
    """Whether an Authorization header is 'Bearer SECRET', in constant time. Compared as
    bytes, so a header that is not ASCII is simply wrong (str comparison would raise)."""
    sent = header.encode("utf-8", "surrogateescape")
    return hmac.compare_digest(sent, f"Bearer {secret}".encode())


def api_key_refusal(request: web.Request, api_key: str | None) -> web.Response | None:
    """With an API key set, a /v1/* request without it is refused (401)."""
    if (
        api_key
        and request.path.startswith("/v1/")
        and not bearer_matches(request.headers.get("Authorization", ""), api_key)
    ):
        return error_response(
            401,
            "missing or wrong API key: send 'Authorization: Bearer <key>'",
            "authentication_error",
        )
    return None


def admin_refusal(request: web.Request, token: str | None) -> web.Response | None:
    """The admin API is off without a token (403), and refused without the token (401)."""
    if not token:
        return error_response(
            403,
            "the admin API is off: start the proxy with --admin-token TOKEN "
            "(or $KVPUSH_ADMIN_TOKEN)",
            "permission_error",
        )
    if not bearer_matches(request.headers.get("Authorization", ""), token):
        return error_response(
            401,
            "missing or wrong admin token: send 'Authorization: Bearer <admin token>'",
            "authentication_error",
        )
    return None
