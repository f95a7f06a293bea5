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
import secrets
import socket

__all__ = ["unique_holder_id"]


def unique_holder_id(base: str | None = None) -> str:
    """``base`` (default ``POD_NAME``, else the host name) plus a suffix unique to this call."""
    base = base or os.environ.get("POD_NAME") or socket.gethostname() or "kopf-reconcile"
    return f"{base}-{secrets.token_hex(4)}"
