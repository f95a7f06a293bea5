"""Server-side printing: the ``meta.k8s.io/v1`` Table that ``kubectl get`` asks for.

kubectl requests ``Accept: application/json;as=Table;v=v1;g=meta.k8s.io`` and prints the
columns the server chose: ``Name`` and ``Age`` for every kind, the kind's own columns for
the built-ins kubectl users look at here (a Lease's holder, a Namespace's phase), and a
CRD's ``additionalPrinterColumns`` (simple JSONPaths such as ``.spec.size``) for its objects.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any

from kopf_reconcile.testing.emulated_apiserver.resources import PrinterColumn, ResourceType

Object = dict[str, Any]

_NAME = PrinterColumn(
    "Name",
    "string",
    ".metadata.name",
    "Name must be unique within a namespace. Is required when creating resources, although "
    "some resources may allow a client to request the generation of an appropriate name "
    "automatically. Name is primarily intended for creation idempotence and configuration "
    "definition. Cannot be updated. More info: "
    "http://kubernetes.io/docs/user-guide/identifiers#names",
    format="name",
)
_AGE = PrinterColumn(
    "Age",
    "date",
    ".metadata.creationTimestamp",
    "CreationTimestamp is a timestamp representing the server time when this object was created.",
)
_BUILTIN_COLUMNS: dict[tuple[str, str], tuple[PrinterColumn, ...]] = {
    ("coordination.k8s.io", "Lease"): (
        PrinterColumn(
            "Holder",
            "string",
            ".spec.holderIdentity",
            "holderIdentity contains the identity of the holder of a current lease.",
        ),
    ),
    ("", "Namespace"): (PrinterColumn("Status", "string", ".status.phase"),),
    ("apiextensions.k8s.io", "CustomResourceDefinition"): (),
}
_PATH_STEP = re.compile(r"\.([^.\[\]]+)|\[(\d+)\]")


def wants_table(accept: str) -> bool:
    return "as=Table" in accept


def _columns(resource: ResourceType) -> tuple[PrinterColumn, ...]:
    if resource.custom and resource.printer_columns:
        return (_NAME, *resource.printer_columns)
    return (_NAME, *_BUILTIN_COLUMNS.get((resource.group, resource.kind), ()), _AGE)


def _lookup(obj: Object, json_path: str) -> Any:
    path = json_path.strip()
    if path.startswith("{") and path.endswith("}"):
        path = path[1:-1]
    current: Any = obj
    position = 0
    while position < len(path):
        step = _PATH_STEP.match(path, position)
        if step is None:
            return None  # a JSONPath beyond plain fields and indexes: left blank
        key, index = step.groups()
        if key is not None:
            current = current.get(key) if isinstance(current, dict) else None
        else:
            number = int(index)
            current = (
                current[number] if isinstance(current, list) and number < len(current) else None
            )
        position = step.end()
    return current


def human_age(created: str, now: datetime) -> str:
    """The age of an object, like kubectl's ``HumanDuration``."""
    try:
        seconds = int(
            (
                now - datetime.strptime(created, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
            ).total_seconds()
        )
    except (TypeError, ValueError):
        return "<unknown>"
    seconds = max(seconds, 0)
    minutes, hours, days = seconds // 60, seconds // 3600, seconds // 86400
    if seconds < 120:
        return f"{seconds}s"
    if minutes < 10:
        return f"{minutes}m{seconds % 60}s" if seconds % 60 else f"{minutes}m"
    if hours < 3:
        return f"{minutes}m"
    if hours < 8:
        return f"{hours}h{minutes % 60}m" if minutes % 60 else f"{hours}h"
    if hours < 48:
        return f"{hours}h"
    if days < 8:
        return f"{days}d{hours % 24}h" if hours % 24 else f"{days}d"
    return f"{days}d"


def _cell(column: PrinterColumn, obj: Object, now: datetime) -> Any:
    value = _lookup(obj, column.json_path)
    if column.type == "date":
        return human_age(value, now) if isinstance(value, str) else "<unknown>"
    if value is None:
        return None
    if column.type == "string" and not isinstance(value, str):
        return str(value)
    return value


def _row_object(obj: Object, include_object: str | None) -> Object | None:
    if include_object == "None":
        return None
    if include_object == "Object":
        return obj
    return {
        "kind": "PartialObjectMetadata",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": obj["metadata"],
    }


def table(
    resource: ResourceType, items: list[Object], metadata: Object, include_object: str | None
) -> Object:
    now = datetime.now(UTC)
    columns = _columns(resource)
    rows = []
    for obj in items:
        row: Object = {"cells": [_cell(column, obj, now) for column in columns]}
        row_object = _row_object(
            {**obj, "apiVersion": resource.api_version, "kind": resource.kind}, include_object
        )
        if row_object is not None:
            row["object"] = row_object
        rows.append(row)
    return {
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": metadata,
        "columnDefinitions": [
            {
                "name": column.name,
                "type": "string" if column.type == "date" else column.type,
                "format": column.format,
                "description": column.description,
                "priority": column.priority,
            }
            for column in columns
        ],
        "rows": rows,
    }
