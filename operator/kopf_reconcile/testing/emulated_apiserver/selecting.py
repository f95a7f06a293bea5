"""Label and field selectors, parsed and matched as kube-apiserver does for list and watch.

Label selectors support the whole grammar (``a=b``, ``a==b``, ``a!=b``, ``a in (x,y)``,
``a notin (x,y)``, ``a``, ``!a``, ``a>1``, ``a<1``). Field selectors support ``=``, ``==``
and ``!=`` on ``metadata.name`` and ``metadata.namespace`` for every resource, plus the few
extra fields kube-apiserver indexes for core kinds (events, namespaces, secrets); any other
field is refused with 400 like the real server does.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from kopf_reconcile.testing.emulated_apiserver import errors

Object = dict[str, Any]
Predicate = Callable[[Object], bool]

#: Fields a field selector may use beyond metadata.name/namespace, per kind of the core group.
EXTRA_FIELDS: dict[str, dict[str, str]] = {
    "Event": {
        "involvedObject.kind": "involvedObject.kind",
        "involvedObject.namespace": "involvedObject.namespace",
        "involvedObject.name": "involvedObject.name",
        "involvedObject.uid": "involvedObject.uid",
        "involvedObject.apiVersion": "involvedObject.apiVersion",
        "involvedObject.resourceVersion": "involvedObject.resourceVersion",
        "involvedObject.fieldPath": "involvedObject.fieldPath",
        "reason": "reason",
        "reportingComponent": "reportingComponent",
        "source": "source.component",
        "type": "type",
    },
    "Namespace": {"status.phase": "status.phase"},
    "Secret": {"type": "type"},
}

_LABEL_REQUIREMENT = re.compile(
    r"""^\s*(?:
        (?P<absent>!)\s*(?P<absent_key>[^\s,!=<>()]+)
      | (?P<set_key>[^\s,!=<>()]+)\s+(?P<set_op>in|notin)\s*\((?P<values>[^()]*)\)
      | (?P<cmp_key>[^\s,!=<>()]+)\s*(?P<cmp_op>==|=|!=|>|<)\s*(?P<value>[^\s,!=<>()]*)
      | (?P<exists_key>[^\s,!=<>()]+)
    )\s*$""",
    re.VERBOSE,
)


def _split_requirements(selector: str) -> list[str]:
    """Split on commas that are not inside ``in (...)`` value sets."""
    parts: list[str] = []
    depth = 0
    current: list[str] = []
    for char in selector:
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    parts.append("".join(current))
    return [part for part in parts if part.strip()]


def parse_label_selector(selector: str) -> Predicate | None:
    """A predicate on an object's labels, or None for the empty (match-all) selector."""
    checks: list[Callable[[dict[str, str]], bool]] = []
    for requirement in _split_requirements(selector):
        match = _LABEL_REQUIREMENT.match(requirement)
        if match is None:
            raise errors.bad_request(f"unable to parse requirement: {requirement.strip()!r}")
        checks.append(_label_check(match))
    if not checks:
        return None

    def matches(obj: Object) -> bool:
        labels = obj.get("metadata", {}).get("labels") or {}
        return all(check(labels) for check in checks)

    return matches


def _label_check(match: re.Match[str]) -> Callable[[dict[str, str]], bool]:
    if match["absent"]:
        key = match["absent_key"]
        return lambda labels: key not in labels
    if match["set_key"]:
        key = match["set_key"]
        values = frozenset(v.strip() for v in match["values"].split(",") if v.strip())
        if match["set_op"] == "in":
            return lambda labels: labels.get(key) in values
        return lambda labels: labels.get(key) not in values
    if match["cmp_key"]:
        key, op, value = match["cmp_key"], match["cmp_op"], match["value"]
        if op in ("=", "=="):
            return lambda labels: labels.get(key) == value
        if op == "!=":
            return lambda labels: labels.get(key) != value
        try:
            bound = int(value)
        except ValueError:
            raise errors.bad_request(
                f"unable to parse requirement: for 'Gt', 'Lt' operators, "
                f"the value must be an integer: {value!r}"
            ) from None

        def compare(labels: dict[str, str]) -> bool:
            number = _integer_label(labels.get(key))
            return number is not None and (number > bound if op == ">" else number < bound)

        return compare
    key = match["exists_key"]
    return lambda labels: key in labels


def _integer_label(value: str | None) -> int | None:
    try:
        return None if value is None else int(value)
    except ValueError:
        return None


def parse_field_selector(selector: str, kind: str, custom: bool) -> Predicate | None:
    """A predicate on an object's selectable fields, or None for the empty selector."""
    allowed = {"metadata.name": "metadata.name", "metadata.namespace": "metadata.namespace"}
    if not custom:
        allowed.update(EXTRA_FIELDS.get(kind, {}))
    checks: list[tuple[list[str], bool, str]] = []
    for requirement in _split_requirements(selector):
        match = re.fullmatch(r"\s*([^=!\s]+)\s*(==|=|!=)\s*(\S*)\s*", requirement)
        if match is None:
            raise errors.bad_request(
                f"invalid selector: {selector!r}; can't understand {requirement!r}"
            )
        field, op, value = match.groups()
        if field not in allowed:
            known = ", ".join(f'"{name}"' for name in allowed)
            raise errors.bad_request(f'"{field}" is not a known field selector: only {known}')
        checks.append((allowed[field].split("."), op != "!=", value))
    if not checks:
        return None

    def matches(obj: Object) -> bool:
        return all((_field_value(obj, path) == value) is equal for path, equal, value in checks)

    return matches


def _field_value(obj: Object, path: list[str]) -> str:
    current: Any = obj
    for step in path:
        if not isinstance(current, dict):
            return ""
        current = current.get(step)
    return "" if current is None else str(current)
