"""PATCH bodies: JSON merge patch (RFC 7386), JSON patch (RFC 6902) and strategic merge patch.

The functions take the current object and the decoded patch and return a new object; they
never mutate their inputs. A JSON patch that cannot apply (a failed ``test``, a missing
path) raises :class:`PatchFailed`, answered with 422 like kube-apiserver does; an
undecodable patch is 400.

Strategic merge patch is applied as a merge patch with its ``$``-directives removed. That is
exact for every field whose Go type has no ``patchMergeKey`` (all of Lease, Namespace,
ConfigMap, Secret, Event but their metadata lists) and close enough for tests; the list
merge semantics of strategic merge (merging ``ownerReferences`` by uid) are not emulated.
"""

from __future__ import annotations

import copy
from typing import Any

from kopf_reconcile.testing.emulated_apiserver import errors

MERGE_PATCH = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: objects merge recursively, ``null`` deletes, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def strategic_merge_patch(target: Any, patch: Any) -> Any:
    """Strategic merge patch, approximated as a merge patch without the ``$`` directives."""
    return merge_patch(target, _without_directives(patch))


def _without_directives(patch: Any) -> Any:
    if isinstance(patch, dict):
        return {k: _without_directives(v) for k, v in patch.items() if not k.startswith("$")}
    if isinstance(patch, list):
        return [_without_directives(item) for item in patch]
    return patch


def json_patch(target: Any, operations: Any) -> Any:
    """RFC 6902, applied atomically: the result, or a 422 error naming the failing operation."""
    if not isinstance(operations, list) or not all(isinstance(op, dict) for op in operations):
        raise errors.bad_request(
            "json: cannot unmarshal object into Go value of type jsonpatch.Patch"
        )
    document = copy.deepcopy(target)
    for operation in operations:
        document = _apply_operation(document, operation)
    return document


class PatchFailed(ValueError):
    """A JSON patch operation that cannot be applied (kube-apiserver answers 422)."""


def _apply_operation(document: Any, operation: dict[str, Any]) -> Any:
    op = operation.get("op")
    path = operation.get("path")
    if not isinstance(path, str):
        raise PatchFailed(f"operation {op!r} is missing a path")
    if op == "test":
        actual = _get(document, _parse_pointer(path), path)
        if not json_equal(actual, operation.get("value")):
            raise PatchFailed(f"testing value {path} failed: test failed")
        return document
    if op == "remove":
        return _remove(document, _parse_pointer(path), path)
    if op == "add":
        return _add(document, _parse_pointer(path), _value(operation), path)
    if op == "replace":
        tokens = _parse_pointer(path)
        _get(document, tokens, path)  # the target must exist
        return _add(_remove(document, tokens, path), tokens, _value(operation), path)
    if op in ("move", "copy"):
        source = operation.get("from")
        if not isinstance(source, str):
            raise PatchFailed(f"operation {op!r} is missing a from path")
        value = copy.deepcopy(_get(document, _parse_pointer(source), source))
        if op == "move":
            document = _remove(document, _parse_pointer(source), source)
        return _add(document, _parse_pointer(path), value, path)
    raise PatchFailed(f"Unexpected kind: {op}")


def _value(operation: dict[str, Any]) -> Any:
    if "value" not in operation:
        raise PatchFailed(f"operation {operation.get('op')!r} is missing a value")
    return copy.deepcopy(operation["value"])


def _parse_pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise PatchFailed(f"invalid JSON pointer: {path!r}")
    return [token.replace("~1", "/").replace("~0", "~") for token in path[1:].split("/")]


def _index(container: list[Any], token: str, path: str, *, for_insert: bool) -> int:
    if token == "-" and for_insert:
        return len(container)
    if not token.isdigit() or (len(token) > 1 and token.startswith("0")):
        raise PatchFailed(f"invalid array index {token!r} in {path}")
    index = int(token)
    if index > len(container) or (index == len(container) and not for_insert):
        raise PatchFailed(f"array index out of bounds in {path}")
    return index


def _get(document: Any, tokens: list[str], path: str) -> Any:
    current = document
    for token in tokens:
        if isinstance(current, dict):
            if token not in current:
                raise PatchFailed(
                    f"unable to get nonexistent key: {token}: missing value in {path}"
                )
            current = current[token]
        elif isinstance(current, list):
            current = current[_index(current, token, path, for_insert=False)]
        else:
            raise PatchFailed(f"doc is missing path: {path}: missing value")
    return current


def _add(document: Any, tokens: list[str], value: Any, path: str) -> Any:
    if not tokens:
        return value
    parent = _get(document, tokens[:-1], path)
    last = tokens[-1]
    if isinstance(parent, dict):
        parent[last] = value
    elif isinstance(parent, list):
        parent.insert(_index(parent, last, path, for_insert=True), value)
    else:
        raise PatchFailed(f"doc is missing path: {path}: missing value")
    return document


def _remove(document: Any, tokens: list[str], path: str) -> Any:
    if not tokens:
        return None
    parent = _get(document, tokens[:-1], path)
    last = tokens[-1]
    if isinstance(parent, dict):
        if last not in parent:
            raise PatchFailed(f"Unable to remove nonexistent key: {last}: missing value")
        del parent[last]
    elif isinstance(parent, list):
        del parent[_index(parent, last, path, for_insert=False)]
    else:
        raise PatchFailed(f"doc is missing path: {path}: missing value")
    return document


def json_equal(left: Any, right: Any) -> bool:
    """Equality of JSON values: unlike Python's ==, ``true`` is not ``1``."""
    if isinstance(left, bool) or isinstance(right, bool):
        return type(left) is type(right) and left == right
    if isinstance(left, dict) and isinstance(right, dict):
        return left.keys() == right.keys() and all(json_equal(left[k], right[k]) for k in left)
    if isinstance(left, list) and isinstance(right, list):
        return len(left) == len(right) and all(map(json_equal, left, right))
    if isinstance(left, int | float) and isinstance(right, int | float):
        return left == right
    return type(left) is type(right) and left == right
