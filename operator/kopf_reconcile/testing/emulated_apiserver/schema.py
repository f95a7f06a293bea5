"""Structural schemas of custom resources: validation, pruning and defaulting.

A CRD version's ``openAPIV3Schema`` governs its objects as in kube-apiserver:

* *pruning*: fields the schema does not declare are dropped (unless a node says
  ``x-kubernetes-preserve-unknown-fields: true``), and ``null`` is dropped where the schema
  does not say ``nullable``;
* *defaulting*: missing fields with a ``default`` get it;
* *validation*: the result must satisfy the schema, else 422 Invalid with one cause per
  violated rule, rendered like kube-apiserver's field errors.

``apiVersion``, ``kind`` and ``metadata`` at the root are never pruned or validated by the
schema (ObjectMeta has its own rules). Validation uses the ``jsonschema`` package (draft 4,
OpenAPI 3.0's base), after translating the Kubernetes extensions (``nullable``,
``x-kubernetes-int-or-string``); CEL rules (``x-kubernetes-validations``) and ``format``
checks are not evaluated.
"""

from __future__ import annotations

import copy
from typing import Any

import jsonschema

from kopf_reconcile.testing.emulated_apiserver.errors import FieldError, go_repr

Object = dict[str, Any]
Schema = dict[str, Any]

_ROOT_FIELDS = ("apiVersion", "kind", "metadata")
_EMBEDDED_FIELDS = ("apiVersion", "kind", "metadata")


def _to_json_schema(node: Any) -> Any:
    """Translate an OpenAPI v3 schema with Kubernetes extensions into a draft-4 JSON schema."""
    if isinstance(node, list):
        return [_to_json_schema(item) for item in node]
    if not isinstance(node, dict):
        return node
    result: Schema = {}
    for key, value in node.items():
        if key.startswith("x-kubernetes-") or key in ("nullable", "default", "example", "format"):
            continue
        if key in ("properties", "patternProperties", "definitions"):
            result[key] = {name: _to_json_schema(sub) for name, sub in value.items()}
        else:
            result[key] = _to_json_schema(value)
    if node.get("x-kubernetes-int-or-string") and "type" not in node:
        result["type"] = ["integer", "string"]
    if node.get("nullable") and "type" in result:
        types = result["type"] if isinstance(result["type"], list) else [result["type"]]
        result["type"] = [*types, "null"]
        if "enum" in result:
            result["enum"] = [*result["enum"], None]
    return result


def _field_path(path: Any) -> str:
    rendered = ""
    for step in path:
        rendered += (
            f"[{step}]" if isinstance(step, int) else (f".{step}" if rendered else str(step))
        )
    return rendered


class StructuralSchema:
    """One version's ``openAPIV3Schema``, compiled once when the CRD is applied."""

    def __init__(self, openapi_schema: Schema) -> None:
        self.openapi_schema = openapi_schema
        body_schema = copy.deepcopy(openapi_schema)
        for field in _ROOT_FIELDS:
            body_schema.get("properties", {}).pop(field, None)
        self._validator = jsonschema.Draft4Validator(_to_json_schema(body_schema))

    def validate(self, obj: Object) -> list[FieldError]:
        body = {k: v for k, v in obj.items() if k not in _ROOT_FIELDS}
        problems = []
        for error in sorted(
            self._validator.iter_errors(body), key=lambda e: list(map(str, e.absolute_path))
        ):
            problems.append(_as_field_error(error))
        return problems

    def prune_and_default(self, obj: Object) -> Object:
        result = _prune(obj, self.openapi_schema, root=True)
        _default(result, self.openapi_schema)
        assert isinstance(result, dict)
        return result


def _as_field_error(error: jsonschema.ValidationError) -> FieldError:
    path = list(error.absolute_path)
    field = _field_path(path) or "<root>"
    value = error.instance
    validator = error.validator
    if validator == "required":
        missing = error.message.split("'")[1] if "'" in error.message else ""
        return FieldError.required(_field_path([*path, missing]) if missing else field)
    expected: Any = error.validator_value
    if validator == "type":
        expected_text = expected if isinstance(expected, str) else " or ".join(expected)
        shown = go_repr(value)
        body = f"Invalid value: {shown}: {field} in body must be of type {expected_text}: {shown}"
        return FieldError(field, "FieldValueTypeInvalid", body)
    if validator == "enum":
        return FieldError.not_supported(field, value, [str(v) for v in expected])
    detail = _RULES.get(str(validator), "must satisfy {rule} {limit}").format(
        field=field, rule=validator, limit=error.validator_value
    )
    return FieldError.invalid(field, value, detail)


_RULES = {
    "maximum": "{field} in body should be less than or equal to {limit}",
    "minimum": "{field} in body should be greater than or equal to {limit}",
    "maxLength": "{field} in body should be at most {limit} chars long",
    "minLength": "{field} in body should be at least {limit} chars long",
    "maxItems": "{field} in body should have at most {limit} items",
    "minItems": "{field} in body should have at least {limit} items",
    "maxProperties": "{field} in body should have at most {limit} properties",
    "minProperties": "{field} in body should have at least {limit} properties",
    "pattern": "{field} in body should match '{limit}'",
    "multipleOf": "{field} in body should be a multiple of {limit}",
    "uniqueItems": "{field} in body shouldn't contain duplicates",
}


def _prune(value: Any, schema: Schema, *, root: bool = False) -> Any:
    if isinstance(value, list):
        items = schema.get("items")
        return [_prune(item, items) for item in value] if isinstance(items, dict) else value
    if not isinstance(value, dict):
        return value
    properties: dict[str, Schema] = schema.get("properties") or {}
    additional = schema.get("additionalProperties")
    preserve = bool(schema.get("x-kubernetes-preserve-unknown-fields"))
    kept_as_is = (
        _ROOT_FIELDS
        if root
        else _EMBEDDED_FIELDS
        if schema.get("x-kubernetes-embedded-resource")
        else ()
    )
    result: Object = {}
    for key, item in value.items():
        if key in kept_as_is:
            result[key] = item
        elif key in properties:
            sub = properties[key]
            if item is None and not sub.get("nullable"):
                continue  # null where null is not allowed is pruned, then defaulted
            result[key] = _prune(item, sub)
        elif isinstance(additional, dict):
            result[key] = _prune(item, additional)
        elif preserve or additional is True:
            result[key] = item
    return result


def _default(value: Any, schema: Schema) -> None:
    if isinstance(value, list):
        items = schema.get("items")
        if isinstance(items, dict):
            for item in value:
                _default(item, items)
        return
    if not isinstance(value, dict):
        return
    for key, sub in (schema.get("properties") or {}).items():
        if key not in value and "default" in sub:
            value[key] = copy.deepcopy(sub["default"])
        if key in value:
            _default(value[key], sub)
    additional = schema.get("additionalProperties")
    if isinstance(additional, dict):
        for key, item in value.items():
            if key not in (schema.get("properties") or {}):
                _default(item, additional)
