"""API errors as kube-apiserver reports them: ``Status`` bodies with its reasons and codes.

Every failure the embedded cluster answers is an :class:`ApiError` carrying the exact
``Status`` document a real kube-apiserver would send (``kind: Status``, ``apiVersion: v1``,
``metadata: {}``, ``status: Failure``, ``message``, ``reason``, ``details``, ``code``), so
clients that branch on ``reason`` or ``code`` behave the same on both. Empty fields are
omitted, as Go's ``omitempty`` does (e.g. ``details.group`` for the core group).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

#: The reason kube-apiserver gives for each status code it answers with a generic error.
REASONS_BY_CODE: dict[int, str] = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    405: "MethodNotAllowed",
    406: "NotAcceptable",
    409: "Conflict",
    410: "Expired",
    415: "UnsupportedMediaType",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
    504: "Timeout",
}


@dataclass(frozen=True)
class Target:
    """What an error is about: the resource (plural), its group, the object's name and kind."""

    group: str
    plural: str
    kind: str
    name: str

    @property
    def group_resource(self) -> str:
        """``leases.coordination.k8s.io``; just ``namespaces`` for the core group."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    @property
    def group_kind(self) -> str:
        """``Lease.coordination.k8s.io``; just ``Namespace`` for the core group."""
        return f"{self.kind}.{self.group}" if self.group else self.kind


@dataclass(frozen=True)
class FieldError:
    """One invalid field, rendered like Go's ``field.Error`` (``spec.x: Invalid value: 0: ...``)."""

    field: str
    reason: str  # FieldValueInvalid, FieldValueRequired, FieldValueNotSupported, ...
    body: str  # e.g. 'Invalid value: 0: must be greater than 0'

    @classmethod
    def invalid(cls, field: str, value: Any, detail: str) -> FieldError:
        return cls(field, "FieldValueInvalid", f"Invalid value: {go_repr(value)}: {detail}")

    @classmethod
    def required(cls, field: str, detail: str = "") -> FieldError:
        body = f"Required value: {detail}" if detail else "Required value"
        return cls(field, "FieldValueRequired", body)

    @classmethod
    def forbidden(cls, field: str, detail: str) -> FieldError:
        return cls(field, "FieldValueForbidden", f"Forbidden: {detail}")

    @classmethod
    def not_supported(cls, field: str, value: Any, allowed: Iterable[str]) -> FieldError:
        choices = ", ".join(json.dumps(choice) for choice in allowed)
        body = f"Unsupported value: {go_repr(value)}: supported values: {choices}"
        return cls(field, "FieldValueNotSupported", body)

    def __str__(self) -> str:
        return f"{self.field}: {self.body}"

    def as_cause(self) -> dict[str, str]:
        return {"reason": self.reason, "message": self.body, "field": self.field}


def go_repr(value: Any) -> str:
    """A value as Go's ``%#v``-ish rendering in field errors: strings quoted, numbers bare."""
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value)
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


class ApiError(Exception):
    """A failed request, carrying the ``Status`` body and HTTP code to answer with."""

    def __init__(
        self,
        code: int,
        message: str,
        reason: str | None = None,
        details: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason if reason is not None else REASONS_BY_CODE.get(code, "Unknown")
        self.details = details

    def status(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
        }
        if self.reason:  # errors passed through from storage carry none
            body["reason"] = self.reason
        if self.details is not None:
            body["details"] = self.details
        body["code"] = self.code
        return body


def _details(target: Target, *, by_kind: bool = False) -> dict[str, Any]:
    details: dict[str, Any] = {}
    if target.name:
        details["name"] = target.name
    if target.group:
        details["group"] = target.group
    # kube-apiserver puts the resource (plural) into "kind" for most errors, the Kind for Invalid.
    details["kind"] = target.kind if by_kind else target.plural
    return details


def not_found(target: Target) -> ApiError:
    message = f'{target.group_resource} "{target.name}" not found'
    return ApiError(404, message, "NotFound", _details(target))


def already_exists(target: Target) -> ApiError:
    message = f'{target.group_resource} "{target.name}" already exists'
    return ApiError(409, message, "AlreadyExists", _details(target))


def conflict(target: Target, detail: str) -> ApiError:
    message = f'Operation cannot be fulfilled on {target.group_resource} "{target.name}": {detail}'
    return ApiError(409, message, "Conflict", _details(target))


def stale_resource_version(target: Target) -> ApiError:
    return conflict(
        target,
        "the object has been modified; please apply your changes to the latest version and "
        "try again",
    )


def invalid(target: Target, errors: Sequence[FieldError]) -> ApiError:
    # Go's ErrorList.ToAggregate: a message repeated in the list is rendered once.
    unique = list(dict.fromkeys(map(str, errors)))
    rendered = unique[0] if len(unique) == 1 else "[" + ", ".join(unique) + "]"
    message = f'{target.group_kind} "{target.name}" is invalid: {rendered}'
    details = _details(target, by_kind=True)
    details["causes"] = [error.as_cause() for error in errors]
    return ApiError(422, message, "Invalid", details)


def resource_version_required(target: Target) -> ApiError:
    """A PUT without ``metadata.resourceVersion`` for a kind that forbids unconditional updates.

    kube-apiserver's registry names the resource (not the Kind) in this one.
    """
    as_resource = Target(target.group, target.plural, target.plural, target.name)
    missing = FieldError(
        "metadata.resourceVersion",
        "FieldValueInvalid",
        "Invalid value: 0: must be specified for an update",
    )
    return invalid(as_resource, [missing])


def invalid_options(kind: str, errors: Sequence[FieldError]) -> ApiError:
    """Invalid query parameters (``ListOptions``, ``PatchOptions`` of ``meta.k8s.io``)."""
    return invalid(Target(group="meta.k8s.io", plural="", kind=kind, name=""), errors)


def bad_request(message: str) -> ApiError:
    return ApiError(400, message, "BadRequest")


def undecodable(target: Target, version: str, detail: str) -> ApiError:
    """A body that does not decode into the kind's Go type (wrong field types, bad MicroTime)."""
    kind = target.kind
    return bad_request(f'{kind} in version "{version}" cannot be handled as a {kind}: {detail}')


def resource_not_served() -> ApiError:
    """An unknown resource under a known API path (kube-apiserver's exact wording)."""
    return ApiError(404, "the server could not find the requested resource", "NotFound", {})


def method_not_allowed() -> ApiError:
    message = "the server does not allow this method on the requested resource"
    return ApiError(405, message, "MethodNotAllowed", {})


def unsupported_patch_type(accepted: Iterable[str]) -> ApiError:
    message = (
        "the body of the request was in an unknown format - accepted media types include: "
        + ", ".join(accepted)
    )
    return ApiError(415, message, "UnsupportedMediaType")


def patch_rejected() -> ApiError:
    """A JSON patch that cannot apply: kube-apiserver v1.37 gives no detail beyond this."""
    message = "the server rejected our request due to an error in our request"
    return ApiError(422, message, "Invalid", {})


def expired(message: str) -> ApiError:
    return ApiError(410, message, "Expired")


def too_large_resource_version(requested: int, current: int) -> ApiError:
    """A read newer than the server has seen (after waiting for it): clients retry later."""
    details = {
        "causes": [{"reason": "ResourceVersionTooLarge", "message": "Too large resource version"}],
        "retryAfterSeconds": 1,
    }
    message = f"Timeout: Too large resource version: {requested}, current: {current}"
    return ApiError(504, message, "Timeout", details)


def storage_error(message: str) -> ApiError:
    """An error kube-apiserver passes through from its storage: 500 with no reason."""
    return ApiError(500, message, "")


def forbidden(
    target: Target, detail: str, causes: Sequence[dict[str, str]] | None = None
) -> ApiError:
    message = f'{target.group_resource} "{target.name}" is forbidden: {detail}'
    details = _details(target)
    if causes:
        details["causes"] = list(causes)
    return ApiError(403, message, "Forbidden", details)


def apply_conflict(conflicts: Sequence[tuple[str, str]]) -> ApiError:
    """Server-side apply conflicts: (manager as printed, field path) pairs, sorted by path."""
    causes = [
        {"reason": "FieldManagerConflict", "message": f"conflict with {manager}", "field": path}
        for manager, path in conflicts
    ]
    if len(conflicts) == 1:
        manager, path = conflicts[0]
        message = f"Apply failed with 1 conflict: conflict with {manager}: {path}"
    else:
        lines: list[str] = []
        for manager in sorted({manager for manager, _ in conflicts}):
            lines.append(f"conflicts with {manager}:")
            lines.extend(f"- {path}" for other, path in conflicts if other == manager)
        message = f"Apply failed with {len(conflicts)} conflicts: " + "\n".join(lines)
    return ApiError(409, message, "Conflict", {"causes": causes})


def for_code(code: int, message: str) -> ApiError:
    """A generic error for a code (used by fault injection)."""
    return ApiError(code, message, REASONS_BY_CODE.get(code, "Unknown"), {})
