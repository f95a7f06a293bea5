"""Errors of remote calls as one line a person can act on, and whether retrying can help.

kubernetes-asyncio's ``ApiException`` carries the HTTP status, its reason phrase and the
API server's ``Status`` body (whose ``message`` says what is wrong: ``namespaces "x" not
found``, ``leases ... is forbidden``), yet its ``repr`` is ``ApiException()`` and its
``str`` spans a dozen lines of headers. :func:`describe_error` renders any exception on
one line, an API error as ``<status> <reason phrase> (<Status reason>): <message>``.

:func:`is_permanent` tells a client error that no retry fixes (403 Forbidden, 404 Not
Found of the namespace, 422 Invalid: the configuration or the permissions must change)
from the transient ones. Timeouts (408), conflicts (409, the normal outcome of a race
for a lease) and throttling (429) are not permanent. The exception is recognised by its
attributes (``status``, ``reason``, ``body``), so this module needs no API client.
"""

from __future__ import annotations

import json

__all__ = ["api_status", "describe_error", "is_permanent"]

_TRANSIENT_CLIENT_ERRORS = frozenset({408, 409, 429})


def api_status(exc: BaseException) -> int | None:
    """The HTTP status of an API client's error, or None for any other exception."""
    status = getattr(exc, "status", None)
    if isinstance(status, int) and not isinstance(status, bool) and hasattr(exc, "body"):
        return status
    return None


def is_permanent(exc: BaseException) -> bool:
    """Whether the server refused the request in a way that retrying cannot fix."""
    status = api_status(exc)
    return status is not None and 400 <= status < 500 and status not in _TRANSIENT_CLIENT_ERRORS


def describe_error(exc: BaseException) -> str:
    """One line: the API status, reason and message of an API error; else type and text."""
    status = api_status(exc)
    if status is None:
        text = " ".join(str(exc).split())
        return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    phrase = getattr(exc, "reason", None)
    status_reason, message = _status_body(getattr(exc, "body", None))
    line = f"{type(exc).__name__}: {status}"
    if isinstance(phrase, str) and phrase:
        line += f" {phrase}"
    if status_reason and status_reason != phrase:
        line += f" ({status_reason})"
    if message:
        line += f": {message}"
    return line


def _status_body(body: object) -> tuple[str | None, str | None]:
    """``reason`` and ``message`` of a kube-apiserver ``Status`` body, else the body's text."""
    if isinstance(body, bytes):
        body = body.decode(errors="replace")
    if not isinstance(body, str) or not body.strip():
        return None, None
    try:
        document = json.loads(body)
    except ValueError:
        return None, " ".join(body.split())[:500]
    if not isinstance(document, dict):
        return None, " ".join(body.split())[:500]
    reason, message = document.get("reason"), document.get("message")
    return (
        reason if isinstance(reason, str) and reason else None,
        " ".join(message.split()) if isinstance(message, str) and message else None,
    )
