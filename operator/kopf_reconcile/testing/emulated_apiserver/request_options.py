"""What a request to the embedded API server asks: its query options and its body.

kube-apiserver's option rules, as v1.37 applies them: ``ListOptions``
(``resourceVersionMatch`` and what it excludes), ``PatchOptions`` (apply needs a
field manager, ``force`` is for apply only), the write options (``dryRun``,
``fieldValidation``), ``resourceVersion`` and ``continue`` tokens; and bodies in
JSON, YAML (read as Kubernetes reads it: timestamps stay strings) or protobuf.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

import yaml
from aiohttp import web

from kopf_reconcile.testing.emulated_apiserver import errors, patching, protobuf
from kopf_reconcile.testing.emulated_apiserver.registry import FIELD_VALIDATIONS, WriteOptions


def flag(value: str | None) -> bool:
    return value is not None and value.lower() in ("true", "1")


def non_negative_int(value: str, name: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise errors.bad_request(f"invalid {name}: {value!r}") from None
    if number < 0:
        raise errors.bad_request(f"invalid {name}: {value!r}")
    return number


def resource_version(request: web.Request, *, listing: bool = False) -> int:
    """The ``resourceVersion`` parameter; 0 when absent or ``0`` (any state will do).

    One that is not a number is a storage error (500) for a get or a watch; a list checks
    it first and answers 400.
    """
    raw = request.query.get("resourceVersion", "")
    if not raw:
        return 0
    if not raw.isascii() or not raw.isdigit():
        quoted = json.dumps(raw)
        message = (
            f"resourceVersion: Invalid value: {quoted}: strconv.ParseUint: parsing {quoted}: "
            "invalid syntax"
        )
        if listing:
            raise errors.bad_request(f"invalid resource version: {message}")
        raise errors.storage_error(message)
    return int(raw)


class _YamlLoader(yaml.SafeLoader):
    """YAML read as Kubernetes reads it (converted to JSON): timestamps stay strings."""


_YamlLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}


async def read_yaml(request: web.Request) -> Any:
    try:
        return yaml.load(await request.read(), Loader=_YamlLoader)  # a SafeLoader subclass
    except (UnicodeDecodeError, yaml.YAMLError) as exc:
        raise errors.bad_request(f"error encoding patch: yaml: {exc}") from None


async def read_json(request: web.Request) -> Any:
    raw = await request.read()
    try:
        return json.loads(raw) if raw else None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise errors.bad_request(f"error decoding patch: {exc}") from None


async def read_body(request: web.Request) -> Any:
    raw = await request.read()
    content_type = request.content_type
    try:
        if content_type in ("application/yaml", "application/x-yaml"):
            return yaml.load(raw, Loader=_YamlLoader)  # a SafeLoader subclass
        if content_type in ("application/json", "application/octet-stream", ""):
            return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, yaml.YAMLError) as exc:
        raise errors.bad_request(f"couldn't get version/kind; json parse error: {exc}") from None
    if content_type == protobuf.MEDIA_TYPE:
        return protobuf.decode(raw)  # what kubectl create sends for built-in kinds
    raise errors.ApiError(
        415,
        f"the body of the request was in an unknown format - accepted media types include: "
        f"application/json, application/yaml, {protobuf.MEDIA_TYPE} (got {content_type})",
        "UnsupportedMediaType",
    )


def check_list_options(request: web.Request) -> None:
    """kube-apiserver v1.37's ListOptions rules, for lists and for watches (WatchList:
    ``sendInitialEvents`` asks a watch to start with the current state)."""
    query = request.query
    match = query.get("resourceVersionMatch", "")
    initial_events = "sendInitialEvents" in query
    problems: list[errors.FieldError] = []

    def forbidden(field: str, reason: str) -> None:
        problems.append(errors.FieldError.forbidden(field, reason))

    if flag(query.get("watch")):
        if initial_events and match != "NotOlderThan":
            forbidden(
                "resourceVersionMatch",
                "sendInitialEvents requires setting resourceVersionMatch to NotOlderThan",
            )
        if match:
            if not initial_events:
                forbidden(
                    "resourceVersionMatch",
                    "resourceVersionMatch is forbidden for watch unless sendInitialEvents is "
                    "provided",
                )
            if match != "NotOlderThan":
                problems.append(
                    errors.FieldError.not_supported(
                        "resourceVersionMatch", match, ("NotOlderThan",)
                    )
                )
            if query.get("continue"):
                forbidden(
                    "resourceVersionMatch",
                    "resourceVersionMatch is forbidden when continue is provided",
                )
    else:
        if match:
            if not query.get("resourceVersion"):
                forbidden(
                    "resourceVersionMatch",
                    "resourceVersionMatch is forbidden unless resourceVersion is provided",
                )
            if query.get("continue"):
                forbidden(
                    "resourceVersionMatch",
                    "resourceVersionMatch is forbidden when continue is provided",
                )
            if match not in ("NotOlderThan", "Exact"):
                problems.append(
                    errors.FieldError.not_supported(
                        "resourceVersionMatch", match, ("Exact", "NotOlderThan", "")
                    )
                )
            if match == "Exact" and query.get("resourceVersion") == "0":
                forbidden(
                    "resourceVersionMatch",
                    'resourceVersionMatch "exact" is forbidden for resourceVersion "0"',
                )
        if initial_events:
            forbidden("sendInitialEvents", "sendInitialEvents is forbidden for list")
    if problems:
        raise errors.invalid_options("ListOptions", problems)


def check_patch_options(request: web.Request) -> None:
    """kube-apiserver's PatchOptions rules: apply needs a field manager, ``force`` is for
    apply only."""
    problem = None
    if request.content_type == patching.APPLY_PATCH and not request.query.get("fieldManager"):
        problem = errors.FieldError.required("fieldManager", "is required for apply patch")
    elif request.content_type != patching.APPLY_PATCH and "force" in request.query:
        problem = errors.FieldError.forbidden("force", "may not be specified for non-apply patch")
    if problem is not None:
        raise errors.invalid_options("PatchOptions", [problem])


def write_options(request: web.Request) -> WriteOptions:
    requested = request.query.get("fieldValidation", "Ignore")
    validation = next((known for known in FIELD_VALIDATIONS if known == requested), None)
    if validation is None:
        raise errors.bad_request(
            f"fieldValidation parameter unsupported: {requested} "
            "(must be one of Ignore, Warn, Strict)"
        )
    return WriteOptions(
        dry_run=request.query.get("dryRun") == "All",
        field_validation=validation,
    )


def encode_continue(revision: int, start_after: str) -> str:
    raw = json.dumps({"v": "meta.k8s.io/v1", "rv": revision, "start": start_after}).encode()
    return base64.urlsafe_b64encode(raw).decode()


def decode_continue(token: str) -> tuple[int, str]:
    try:
        decoded = json.loads(base64.urlsafe_b64decode(token.encode()))
        return int(decoded["rv"]), str(decoded["start"])
    except (binascii.Error, ValueError, KeyError, TypeError):
        raise errors.bad_request(
            "continue key is not valid: incorrect encoded start resourceVersion "
            "(version meta.k8s.io/v1)"
        ) from None
