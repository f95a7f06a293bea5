"""Holder identities for lease electors: one per elector instance, never reused.

An elector's identity is what a lease store compares to decide whether a
write comes from the current holder. If two processes shared one (a fixed
name, or a restarted pod reusing its predecessor's), the second could renew
or "re-acquire" the first one's lease at the same epoch, and fencing could no
longer tell them apart. So the identity is ``POD_NAME`` (or the host name),
readable in ``kubectl get leases``, plus a random suffix minted once per
instance.
"""

from __future__ import annotations

import os
import re
import secrets
import socket

from kopf_reconcile.api import ConfigError

__all__ = ["checked_holder_id", "unique_holder_id"]


def unique_holder_id(base: str | None = None) -> str:
    """``base`` (default ``POD_NAME``, else the host name) plus a suffix unique to this call."""
    base = base or os.environ.get("POD_NAME") or socket.gethostname() or "kopf-reconcile"
    return f"{base}-{secrets.token_hex(4)}"


# Whitespace at either end, or a control character: a holder id is also sent as an HTTP
# header value (the fenced API client's), which drops the one and refuses the other, so
# the API server would never see the holder the Lease names.
_UNSENDABLE = re.compile(r"^\s|\s$|[\x00-\x1f\x7f]")


def checked_holder_id(holder_id: object) -> str:
    """``holder_id`` as given (validated), or a new unique one for ``None``."""
    if holder_id is None:
        return unique_holder_id()
    if not isinstance(holder_id, str) or not holder_id:
        raise ConfigError(f"holder_id must be a non-empty string or None, got {holder_id!r}")
    if _UNSENDABLE.search(holder_id):
        raise ConfigError(
            f"holder_id must not start or end with whitespace nor hold control characters "
            f"(it is sent in HTTP headers), got {holder_id!r}"
        )
    return holder_id
