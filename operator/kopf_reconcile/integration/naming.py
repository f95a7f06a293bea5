"""Default reconciler ids of the kopf shim: what is reconciled, then by which function.

A reconciler id names a reconciler's lease (a Kubernetes Lease, or a row of the
PostgreSQL lease table) and, by default, its fenced scope. Two reconcilers that
end up with one id share that lease: only one of them ever leads, the other
stays a healthy follower that never reconciles. Within one operator the shim
refuses a second registration of an id; across operators (several Deployments
in one namespace, one database) nothing can check it, so the default must tell
operators apart by itself, or not be used.

The default id is ``<plural>.<group>-<name>`` (``<plural>-<name>`` for the core
API group), the resource written as kubectl writes a fully qualified resource,
then the controller name (the function's name, or ``name=``) with every run of
characters other than lowercase letters and digits turned into ``-``:
``devices.example.com-reconcile-device``, ``configmaps-reconcile-settings``,
``deployments.apps-scale-workers``. The API version is left out: every version
serves the same objects, and an operator moving from ``v1beta1`` to ``v1`` keeps
its lease. An id longer than :data:`MAX_DEFAULT_ID_LENGTH` is cut and ends with
8 hexadecimal digits of the SHA-256 of the full id, so it stays unique, stable
across restarts and replicas, and short enough for ``kubectl get leases`` and
for use as a label value.

An id is *ambiguous* when the controller name says nothing but that it
reconciles (:func:`is_generic_name`: ``reconcile``, ``handler``, ``main``, a
lambda...): such an id names only the resource, and two operators reconciling
the same resource (ConfigMaps, Secrets, Deployments: many operators watch them)
would share it. With a leader elector the shim then requires an explicit
``reconciler_id=``, as controller-runtime requires ``LeaderElectionID`` whenever
leader election is on.
"""

from __future__ import annotations

import hashlib
import re

__all__ = ["GENERIC_WORDS", "MAX_DEFAULT_ID_LENGTH", "derived_reconciler_id", "is_generic_name"]

MAX_DEFAULT_ID_LENGTH = 63  # a DNS label's (and a label value's) limit; Lease names allow 253

# Words that say how a function is called, not what it is for.
GENERIC_WORDS = frozenset(
    {
        "reconcile", "reconciler", "reconciles", "reconciling", "reconciliation",
        "handle", "handler", "handlers", "handling", "callback", "cb",
        "on", "event", "events", "main", "run", "process", "sync", "do",
        "fn", "func", "function", "f", "lambda", "controller", "operator", "loop",
    }
)  # fmt: skip

_NOT_ALNUM = re.compile(r"[^a-z0-9]+")
_NOT_LABEL = re.compile(r"[^a-z0-9-]+")
_DIGEST_LENGTH = 8


def derived_reconciler_id(group: str, plural: str, name: str) -> str:
    """The default reconciler id of a reconciler of ``group/plural`` called ``name``."""
    resource = ".".join(
        label
        for label in (_NOT_LABEL.sub("-", part).strip("-") for part in _resource(group, plural))
        if label
    )
    function = _NOT_ALNUM.sub("-", name.lower()).strip("-")
    full = "-".join(part for part in (resource, function) if part) or "reconciler"
    if len(full) <= MAX_DEFAULT_ID_LENGTH:
        return full
    digest = hashlib.sha256(full.encode()).hexdigest()[:_DIGEST_LENGTH]
    # A prefix of a valid name is valid once it no longer ends with '-' or '.'.
    head = full[: MAX_DEFAULT_ID_LENGTH - _DIGEST_LENGTH - 1].rstrip("-.")
    return f"{head}-{digest}" if head else digest


def is_generic_name(name: str) -> bool:
    """Whether ``name`` is made only of :data:`GENERIC_WORDS` (or of no word at all)."""
    return all(word in GENERIC_WORDS for word in _NOT_ALNUM.split(name.lower()) if word)


def _resource(group: str, plural: str) -> list[str]:
    return [*plural.lower().split("."), *(group.lower().split(".") if group else [])]
