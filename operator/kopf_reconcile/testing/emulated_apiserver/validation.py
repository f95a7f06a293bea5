"""Decoding and validation of built-in kinds and of every object's metadata.

(Over 400 lines on purpose: the decoding and validation rules of each built-in kind, one
after the other, as kube-apiserver's validation package lists them.)

kube-apiserver rejects a body in two stages, and the embedded cluster keeps them apart:

* *decoding* (400 BadRequest): the JSON does not fit the kind's Go type — a string where an
  ``int32`` goes, a MicroTime without exactly six fractional digits. Unknown fields and
  ``null`` optional fields are dropped silently, as decoding into a Go struct does (a
  ConfigMap sent with a ``status`` is stored without it).
* *validation* (422 Invalid): the decoded object breaks a rule (a name that is not a DNS
  subdomain, a non-positive ``leaseDurationSeconds``), reported as field errors.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Callable
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

from kopf_reconcile.testing.emulated_apiserver import errors
from kopf_reconcile.testing.emulated_apiserver.errors import FieldError
from kopf_reconcile.testing.emulated_apiserver.resources import ResourceType

Object = dict[str, Any]

#: Go's layout of ``metav1.MicroTime``: exactly six fractional digits, always.
MICRO_TIME_LAYOUT = "2006-01-02T15:04:05.000000Z07:00"
_MICRO_TIME = re.compile(
    r"(\d{4})-(\d{2})-(\d{2})T(\d{2}):(\d{2}):(\d{2})\.(\d{6})(Z|[+-]\d{2}:\d{2})"
)
#: Go's layout of ``metav1.Time`` (RFC 3339): any fraction is accepted, then dropped.
TIME_LAYOUT = "2006-01-02T15:04:05Z07:00"
_TIME = re.compile(
    r"(\d{4})-(\d{2})-(\d{2})T(\d{2}):(\d{2}):(\d{2})()(?:\.\d+)?(Z|[+-]\d{2}:\d{2})"
)

_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_QUALIFIED_NAME_PART = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")

DNS_SUBDOMAIN_MESSAGE = (
    "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, "
    "'-' or '.', and must start and end with an alphanumeric character (e.g. 'example.com', "
    "regex used for validation is "
    "'[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')"
)
DNS_LABEL_MESSAGE = (
    "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', "
    "and must start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', "
    "regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')"
)

#: The fields of Go's ObjectMeta; anything else in ``metadata`` is dropped on decoding.
OBJECT_META_FIELDS = frozenset(
    {
        "name",
        "generateName",
        "namespace",
        "selfLink",
        "uid",
        "resourceVersion",
        "generation",
        "creationTimestamp",
        "deletionTimestamp",
        "deletionGracePeriodSeconds",
        "labels",
        "annotations",
        "ownerReferences",
        "finalizers",
        "clusterName",
        "managedFields",
    }
)


def format_time(moment: datetime) -> str:
    """``metav1.Time``: RFC 3339 in UTC, whole seconds."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def format_micro_time(moment: datetime) -> str:
    """``metav1.MicroTime``: RFC 3339 in UTC with exactly six fractional digits."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_micro_time(value: str) -> datetime:
    """Parse as Go's ``time.Parse(RFC3339Micro, ...)``, or raise ValueError with its message."""
    return _parse_time(value, _MICRO_TIME, MICRO_TIME_LAYOUT)


def parse_time(value: str) -> datetime:
    """Parse as Go's ``time.Parse(RFC3339, ...)`` to whole seconds, or raise ValueError."""
    return _parse_time(value, _TIME, TIME_LAYOUT)


def _parse_time(value: str, pattern: re.Pattern[str], layout: str) -> datetime:
    match = pattern.fullmatch(value)
    if match is None:
        raise ValueError(f'parsing time "{value}" as "{layout}": cannot parse "{value}"')
    year, month, day, hour, minute, second = (int(part) for part in match.groups()[:6])
    micro = int(match[7] or 0)
    zone = match[8]
    offset = timedelta(0) if zone == "Z" else _zone_offset(zone)
    try:
        return datetime(year, month, day, hour, minute, second, micro, tzinfo=timezone(offset))
    except ValueError as exc:
        raise ValueError(f'parsing time "{value}": {exc}') from None


def _zone_offset(zone: str) -> timedelta:
    sign = -1 if zone[0] == "-" else 1
    hours, minutes = int(zone[1:3]), int(zone[4:6])
    return sign * timedelta(hours=hours, minutes=minutes)


# Decoding (400): shapes of fields as Go types.


class DecodeError(ValueError):
    """A body that does not fit the Go type; the message is what the server reports."""


def _type_name(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def _mismatch(value: Any, struct: str, path: str, go_type: str) -> DecodeError:
    return DecodeError(
        f"json: cannot unmarshal {_type_name(value)} into Go struct field {struct}.{path} "
        f"of type {go_type}"
    )


def _int32(value: Any, struct: str, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not -(2**31) <= value < 2**31:
        raise _mismatch(value, struct, path, "int32")
    return value


def _string(value: Any, struct: str, path: str) -> str:
    if not isinstance(value, str):
        raise _mismatch(value, struct, path, "string")
    return value


def _string_map(value: Any, struct: str, path: str) -> dict[str, str]:
    if not isinstance(value, dict):
        raise _mismatch(value, struct, path, "map[string]string")
    for item in value.values():
        _string(item, struct, path)
    return value


def _string_list(value: Any, struct: str, path: str) -> list[str]:
    if not isinstance(value, list):
        raise _mismatch(value, struct, path, "[]string")
    for item in value:
        _string(item, struct, path)
    return value


def _micro_time(value: Any, struct: str, path: str) -> str:
    if not isinstance(value, str):
        raise _mismatch(value, struct, path, "v1.MicroTime")
    try:
        return format_micro_time(parse_micro_time(value))
    except ValueError as exc:
        raise DecodeError(str(exc)) from None


def _time(value: Any, struct: str, path: str) -> str:
    if not isinstance(value, str):
        raise _mismatch(value, struct, path, "v1.Time")
    try:
        return format_time(parse_time(value))
    except ValueError as exc:
        raise DecodeError(str(exc)) from None


def decode_metadata(body: Object) -> Object:
    """The body with a well-typed ``metadata`` holding only ObjectMeta's fields."""
    metadata = body.get("metadata")
    if metadata is None:
        return {**body, "metadata": {}}
    if not isinstance(metadata, dict):
        raise _mismatch(metadata, "ObjectMeta", "metadata", "v1.ObjectMeta")
    decoded: Object = {}
    for key, value in metadata.items():
        if key not in OBJECT_META_FIELDS or value is None:
            continue
        if key in ("name", "generateName", "namespace", "uid", "resourceVersion", "selfLink"):
            _string(value, "ObjectMeta", f"metadata.{key}")
        elif key in ("labels", "annotations"):
            _string_map(value, "ObjectMeta", f"metadata.{key}")
        elif key == "finalizers":
            _string_list(value, "ObjectMeta", "metadata.finalizers")
        elif key in ("ownerReferences", "managedFields") and not isinstance(value, list):
            raise _mismatch(value, "ObjectMeta", f"metadata.{key}", "[]v1.OwnerReference")
        decoded[key] = value
    return {**body, "metadata": decoded}


_LeaseField = Callable[[Any, str, str], Any]
_LEASE_SPEC_FIELDS: dict[str, _LeaseField] = {
    "holderIdentity": _string,
    "leaseDurationSeconds": _int32,
    "acquireTime": _micro_time,
    "renewTime": _micro_time,
    "leaseTransitions": _int32,
}


def _decode_lease(body: Object) -> Object:
    spec = body.get("spec") or {}  # a struct in Go: always present, maybe empty
    if not isinstance(spec, dict):
        raise _mismatch(spec, "Lease", "spec", "v1.LeaseSpec")
    decoded = {
        key: _LEASE_SPEC_FIELDS[key](value, "LeaseSpec", f"spec.{key}")
        for key, value in spec.items()
        if key in _LEASE_SPEC_FIELDS and value is not None
    }
    return {**body, "spec": decoded}


def _decode_namespace(body: Object) -> Object:
    spec = body.get("spec") or {}
    finalizers = spec.get("finalizers")
    if finalizers is not None:
        _string_list(finalizers, "NamespaceSpec", "spec.finalizers")
    return body


def _decode_config_map(body: Object) -> Object:
    for field in ("data", "binaryData"):
        if body.get(field) is not None:
            _string_map(body[field], "ConfigMap", field)
    return body


def _decode_secret(body: Object) -> Object:
    data = dict(_string_map(body.get("data") or {}, "Secret", "data"))
    for key, value in data.items():
        try:
            base64.b64decode(value, validate=True)
        except binascii.Error:
            raise DecodeError(f"illegal base64 data in Secret.data[{key}]") from None
    # stringData is write-only: merged into data, never stored.
    for key, value in _string_map(body.get("stringData") or {}, "Secret", "stringData").items():
        data[key] = base64.b64encode(value.encode()).decode()
    decoded = {k: v for k, v in body.items() if k != "stringData"}
    if data:
        decoded["data"] = data
    decoded.setdefault("type", "Opaque")
    return decoded


def _decode_event(body: Object) -> Object:
    decoded = dict(body)
    if body.get("eventTime") is not None:
        decoded["eventTime"] = _micro_time(body["eventTime"], "Event", "eventTime")
    for field in ("firstTimestamp", "lastTimestamp"):
        if body.get(field) is not None:
            decoded[field] = _time(body[field], "Event", field)
    if body.get("count") is not None:
        _int32(body["count"], "Event", "count")
    involved = body.get("involvedObject")
    if involved is not None and not isinstance(involved, dict):
        raise _mismatch(involved, "Event", "involvedObject", "v1.ObjectReference")
    return decoded


_DECODERS: dict[str, Callable[[Object], Object]] = {
    "Event": _decode_event,
    "Lease": _decode_lease,
    "Namespace": _decode_namespace,
    "ConfigMap": _decode_config_map,
    "Secret": _decode_secret,
}

#: The top-level fields of each built-in kind's Go type; others are dropped on decoding.
_TOP_LEVEL_FIELDS: dict[str, frozenset[str]] = {
    "Lease": frozenset({"spec"}),
    "Namespace": frozenset({"spec", "status"}),
    "ConfigMap": frozenset({"data", "binaryData", "immutable"}),
    "Secret": frozenset({"data", "stringData", "type", "immutable"}),
    "CustomResourceDefinition": frozenset({"spec", "status"}),
    "ClusterRole": frozenset({"rules", "aggregationRule"}),
    "ClusterRoleBinding": frozenset({"subjects", "roleRef"}),
    "Event": frozenset(
        {
            "involvedObject",
            "reason",
            "message",
            "source",
            "firstTimestamp",
            "lastTimestamp",
            "count",
            "type",
            "eventTime",
            "series",
            "action",
            "related",
            "reportingComponent",
            "reportingInstance",
        }
    ),
}


def decode(resource: ResourceType, body: Any) -> Object:
    """Decode a request body into the resource's shape, or raise 400 as kube-apiserver does."""
    target = resource.target(
        (body.get("metadata") or {}).get("name", "") if isinstance(body, dict) else ""
    )
    if not isinstance(body, dict):
        raise errors.undecodable(
            target,
            resource.version,
            f"json: cannot unmarshal {_type_name(body)} into Go value of type struct",
        )
    kind = body.get("kind")
    if kind is not None and kind != resource.kind:
        raise errors.bad_request(
            f"the kind in the body ({kind}) does not match the kind of the resource "
            f"({resource.kind})"
        )
    api_version = body.get("apiVersion")
    if api_version is not None and api_version != resource.api_version:
        raise errors.bad_request(
            f"the API version in the data ({api_version}) does not match the expected API version "
            f"({resource.api_version})"
        )
    try:
        decoded = decode_metadata(body)
        known = None if resource.custom else _TOP_LEVEL_FIELDS.get(resource.kind)
        if known is not None:
            decoded = {k: v for k, v in decoded.items() if k in known or k == "metadata"}
        decoder = None if resource.custom else _DECODERS.get(resource.kind)
        if decoder is not None:
            decoded = decoder(decoded)
    except DecodeError as exc:
        raise errors.undecodable(target, resource.version, str(exc)) from None
    rest = {k: v for k, v in decoded.items() if k not in ("apiVersion", "kind")}
    return {"apiVersion": resource.api_version, "kind": resource.kind, **rest}


#: Fields that decoding consumes on purpose (not unknown even though they are not stored).
_WRITE_ONLY_FIELDS = frozenset({"stringData"})


def dropped_fields(sent: Any, kept: Any, path: str = "") -> list[str]:
    """Paths of fields a client sent (non-null) that decoding or pruning did not keep."""
    if isinstance(sent, dict) and isinstance(kept, dict):
        dropped: list[str] = []
        for key, value in sent.items():
            child = f"{path}.{key}" if path else key
            if key not in kept:
                if value is not None and not (not path and key in _WRITE_ONLY_FIELDS):
                    dropped.append(child)
            else:
                dropped.extend(dropped_fields(value, kept[key], child))
        return dropped
    if isinstance(sent, list) and isinstance(kept, list) and len(sent) == len(kept):
        return [
            p
            for i, (a, b) in enumerate(zip(sent, kept, strict=True))
            for p in dropped_fields(a, b, f"{path}[{i}]")
        ]
    return []


# Validation (422): rules on decoded objects.


def validate_name(name: str, *, label: bool) -> list[FieldError]:
    pattern, message, limit = (
        (_DNS_LABEL, DNS_LABEL_MESSAGE, 63)
        if label
        else (_DNS_SUBDOMAIN, DNS_SUBDOMAIN_MESSAGE, 253)
    )
    problems: list[FieldError] = []
    if len(name) > limit:
        problems.append(
            FieldError.invalid("metadata.name", name, f"must be no more than {limit} characters")
        )
    if not pattern.fullmatch(name):
        problems.append(FieldError.invalid("metadata.name", name, message))
    return problems


def _validate_qualified_name(key: str, field: str) -> list[FieldError]:
    """Go's ``IsQualifiedName``: an optional DNS subdomain prefix and a name part."""
    prefix, _, name = key.rpartition("/")
    problems: list[FieldError] = []
    if prefix and (len(prefix) > 253 or not _DNS_SUBDOMAIN.fullmatch(prefix)):
        problems.append(FieldError.invalid(field, key, "prefix part " + DNS_SUBDOMAIN_MESSAGE))
    if not name:
        problems.append(FieldError.invalid(field, key, "name part must be non-empty"))
    elif len(name) > 63:
        problems.append(
            FieldError.invalid(field, key, "name part must be no more than 63 characters")
        )
    if not _QUALIFIED_NAME_PART.fullmatch(name):
        problems.append(
            FieldError.invalid(
                field,
                key,
                "name part must consist of alphanumeric characters, '-', '_' or '.', and must "
                "start and end with an alphanumeric character (e.g. 'MyName',  or 'my.name',  or "
                "'123-abc', regex used for validation is "
                "'([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]')",
            )
        )
    return problems


def validate_metadata(resource: ResourceType, obj: Object) -> list[FieldError]:
    meta = obj["metadata"]
    problems: list[FieldError] = []
    name = meta.get("name", "")
    if not name:
        problems.append(FieldError.required("metadata.name", "name or generateName is required"))
    else:
        problems.extend(validate_name(name, label=resource.kind == "Namespace"))
    for key, value in (meta.get("labels") or {}).items():
        problems.extend(_validate_qualified_name(key, "metadata.labels"))
        if len(value) > 63 or not _LABEL_VALUE.fullmatch(value):
            problems.append(
                FieldError.invalid(
                    "metadata.labels",
                    value,
                    "a valid label must be an empty string or consist of alphanumeric characters, "
                    "'-', '_' or '.', and must start and end with an alphanumeric character",
                )
            )
    for key in meta.get("annotations") or {}:
        problems.extend(_validate_qualified_name(key.lower(), "metadata.annotations"))
    for finalizer in meta.get("finalizers") or []:
        problems.extend(_validate_qualified_name(finalizer, "metadata.finalizers"))
    return problems


def validate_metadata_update(obj: Object, current: Object) -> list[FieldError]:
    """What an update may not change in the metadata: no new finalizers once deleting.

    kube-apiserver v1.37 checks the metadata of an update twice (the generic registry,
    then the kind's own update validation), so the one problem comes back as two causes;
    the message names it once (Go's ErrorList.ToAggregate drops repeated messages).
    """
    if not current["metadata"].get("deletionTimestamp"):
        return []
    old = set(current["metadata"].get("finalizers") or [])
    new = sorted(set(obj["metadata"].get("finalizers") or []) - old)
    if not new:
        return []
    listed = ", ".join(errors.go_repr(finalizer) for finalizer in new)
    problem = FieldError.forbidden(
        "metadata.finalizers",
        "no new finalizers can be added if the object is being deleted, "
        f"found new finalizers []string{{{listed}}}",
    )
    return [problem, problem]


def validate_lease(obj: Object) -> list[FieldError]:
    spec = obj.get("spec") or {}
    problems: list[FieldError] = []
    duration = spec.get("leaseDurationSeconds")
    if duration is not None and duration <= 0:
        problems.append(
            FieldError.invalid("spec.leaseDurationSeconds", duration, "must be greater than 0")
        )
    transitions = spec.get("leaseTransitions")
    if transitions is not None and transitions < 0:
        problems.append(
            FieldError.invalid(
                "spec.leaseTransitions", transitions, "must be greater than or equal to 0"
            )
        )
    return problems


#: Limits of the fields of a new-style core Event (one with an ``eventTime``).
_EVENT_FIELD_LIMIT = 128
_EVENT_MESSAGE_LIMIT = 1024


def validate_event(obj: Object) -> list[FieldError]:
    """kube-apiserver v1.37's rules for core v1 Events.

    An old-style Event (no ``eventTime``, as kopf and client-go's recorder post) must be about
    an object of its own namespace; without an ``involvedObject.namespace`` it may only live
    in ``default``. A new-style Event also needs its reporting controller, instance, action
    and reason.
    """
    namespace = obj["metadata"].get("namespace", "")
    involved_namespace = (obj.get("involvedObject") or {}).get("namespace") or ""
    mismatch = FieldError.invalid(
        "involvedObject.namespace", involved_namespace, "does not match event.namespace"
    )
    if not obj.get("eventTime"):
        if involved_namespace:
            return [] if involved_namespace == namespace else [mismatch]
        return [] if namespace in ("", "default") else [mismatch]
    problems: list[FieldError] = []
    if not involved_namespace and namespace != "kube-system":
        problems.append(mismatch)
    controller = obj.get("reportingComponent") or ""
    if not controller:
        problems.append(FieldError.required("reportingComponent"))
    problems.extend(_validate_qualified_name(controller, "reportingComponent"))
    instance = obj.get("reportingInstance") or ""
    if not instance:
        problems.append(FieldError.required("reportingInstance"))
    elif len(instance) > _EVENT_FIELD_LIMIT:
        problems.append(FieldError.invalid("reportingInstance", "", _at_most(_EVENT_FIELD_LIMIT)))
    for field in ("action", "reason"):
        value = obj.get(field) or ""
        if not value:
            problems.append(FieldError.required(field))
        elif len(value) > _EVENT_FIELD_LIMIT:
            problems.append(FieldError.invalid(field, "", _at_most(_EVENT_FIELD_LIMIT)))
    if len(obj.get("message") or "") > _EVENT_MESSAGE_LIMIT:
        problems.append(FieldError.invalid("message", "", _at_most(_EVENT_MESSAGE_LIMIT)))
    return problems


def _at_most(limit: int) -> str:
    return f"can have at most {limit} characters"


def validate_builtin(resource: ResourceType, obj: Object) -> list[FieldError]:
    if resource.kind == "Lease" and resource.group == "coordination.k8s.io":
        return validate_lease(obj)
    if resource.kind == "Event" and not resource.group:
        return validate_event(obj)
    return []
