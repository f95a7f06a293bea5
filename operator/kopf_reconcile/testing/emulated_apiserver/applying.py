"""Server-side apply (``application/apply-patch+yaml``) and the field ownership it records.

An apply sends the intent of one field manager (``?fieldManager=``): a partial object with
just the fields that manager wants set. kube-apiserver then

* creates the object if it is missing (201), or else sets the applied fields on it (200);
* records in ``metadata.managedFields`` which fields each manager owns (an entry with
  ``operation: Apply`` and ``fieldsType: FieldsV1``, such as ``{"f:spec": {"f:size": {}}}``);
* removes the fields the manager applied last time but applies no more, unless another
  manager owns them too;
* refuses (409 Conflict, one cause per field) to set a field another manager owns to a
  different value, unless ``force=true``, which takes the field over. Applying the value a
  field already has makes the manager a co-owner.

Writes that are not applies keep ``managedFields`` (a client that sends none, or ``[]``,
cannot erase them; ``[{}]`` resets them) and take the fields they change away from their
owners.

The embedded cluster does this with three simplifications, each documented in README.md:

* Only applies are recorded: other writes add no ``operation: Update`` entry. So an apply
  never conflicts with a field last set by a POST, PUT or PATCH (it takes it silently), and
  a field an apply manager shares with such a writer goes when that manager stops applying it.
* Every list is atomic (replaced whole and owned as one field), including those
  kube-apiserver merges by key (``metadata.finalizers``, ``ownerReferences``, CRD lists
  marked ``x-kubernetes-list-type: map`` or ``set``).
* Ownership is of leaf fields: no ``"."`` entry for a map that is owned as a whole.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Iterator
from typing import Any

from kopf_reconcile.testing.emulated_apiserver import errors
from kopf_reconcile.testing.emulated_apiserver.patching import json_equal

Object = dict[str, Any]
#: A field: the keys from the object's root to it, e.g. ``("spec", "holderIdentity")``.
FieldPath = tuple[str, ...]

APPLY = "Apply"

#: Metadata the server sets or the URL gives: never applied by a manager, never owned.
_SERVER_METADATA = frozenset(
    {
        "name",
        "namespace",
        "uid",
        "resourceVersion",
        "generation",
        "creationTimestamp",
        "deletionTimestamp",
        "deletionGracePeriodSeconds",
        "selfLink",
        "managedFields",
    }
)

_MISSING = object()


# Fields of objects.


def applied_fields(config: Object) -> Iterator[tuple[FieldPath, Any]]:
    """The leaf fields an apply configuration sets, with their values.

    Lists are leaves; an empty map sets nothing and owns nothing (as in kube-apiserver).
    """
    for key, value in config.items():
        if key in ("apiVersion", "kind"):
            continue
        if key == "metadata" and isinstance(value, dict):
            for meta_key, meta_value in value.items():
                if meta_key not in _SERVER_METADATA:
                    yield from _leaves(meta_value, ("metadata", meta_key))
        else:
            yield from _leaves(value, (key,))


def _leaves(value: Any, path: FieldPath) -> Iterator[tuple[FieldPath, Any]]:
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _leaves(item, (*path, key))
    else:
        yield path, value


def value_at(obj: Any, path: FieldPath) -> Any:
    """The value of a field, or ``_MISSING``."""
    for key in path:
        if not isinstance(obj, dict) or key not in obj:
            return _MISSING
        obj = obj[key]
    return obj


def present(obj: Any, path: FieldPath) -> bool:
    return value_at(obj, path) is not _MISSING


def _same(left: Any, right: Any) -> bool:
    if left is _MISSING or right is _MISSING:
        return left is right
    return json_equal(left, right)


def _set(obj: Object, path: FieldPath, value: Any) -> None:
    for key in path[:-1]:
        child = obj.get(key)
        if not isinstance(child, dict):
            child = obj[key] = {}
        obj = child
    obj[path[-1]] = copy.deepcopy(value)


def _remove(obj: Object, path: FieldPath) -> None:
    """Remove a field, then the maps it leaves empty (as Go's ``omitempty`` drops them).

    A map that still holds fields stays: they may belong to other managers.
    """
    parents = [obj]
    for key in path[:-1]:
        child = parents[-1].get(key)
        if not isinstance(child, dict):
            return
        parents.append(child)
    value = parents[-1].get(path[-1])
    if isinstance(value, dict) and value:
        return
    parents[-1].pop(path[-1], None)
    for parent, key in zip(reversed(parents[:-1]), reversed(path[:-1]), strict=True):
        if parent.get(key) == {}:
            del parent[key]


# managedFields entries.


def _owned(entry: Object) -> set[FieldPath]:
    owned: set[FieldPath] = set()
    _collect(entry.get("fieldsV1"), (), owned)
    return owned


def _collect(node: Any, path: FieldPath, into: set[FieldPath]) -> None:
    if not isinstance(node, dict):
        return
    named = {key[2:]: sub for key, sub in node.items() if key.startswith("f:")}
    if path and (not named or len(named) < len(node)):
        into.add(path)  # a leaf, a map owned itself ("."), or list items (lists are atomic)
    for key, sub in named.items():
        _collect(sub, (*path, key), into)


def _fields_v1(paths: Iterable[FieldPath]) -> Object:
    root: Object = {}
    for path in sorted(paths):
        node = root
        for key in path:
            node = node.setdefault(f"f:{key}", {})
    return root


def _with_owned(entry: Object, owned: set[FieldPath]) -> Object:
    return {**entry, "fieldsV1": _fields_v1(owned)}


def _is_apply_of(entry: Object, manager: str) -> bool:
    return entry.get("manager") == manager and entry.get("operation") == APPLY


def _printed(entry: Object) -> str:
    """A manager as kube-apiserver names it in conflicts."""
    name = json.dumps(entry.get("manager", ""))
    if entry.get("operation") == APPLY:
        return name
    return f"{name} using {entry.get('apiVersion', '')}"


def apply_entry(manager: str, api_version: str, owned: set[FieldPath], time: str) -> Object:
    return {
        "manager": manager,
        "operation": APPLY,
        "apiVersion": api_version,
        "time": time,
        "fieldsType": "FieldsV1",
        "fieldsV1": _fields_v1(owned),
    }


# Applying.


def applied(
    current: Object,
    config: Object,
    owned: set[FieldPath],
    *,
    manager: str,
    force: bool,
    api_version: str,
    time: str,
) -> Object:
    """``current`` with an apply by ``manager`` merged in, its managedFields updated.

    ``owned`` are the fields of ``config`` the manager comes to own (those the object keeps
    after decoding). Raises the 409 Conflict of kube-apiserver when another manager owns
    one of them with a different value, unless ``force``.
    """
    entries: list[Object] = [
        e for e in current["metadata"].get("managedFields") or [] if isinstance(e, dict)
    ]
    mine = next((e for e in entries if _is_apply_of(e, manager)), None)
    others = [(entry, _owned(entry)) for entry in entries if entry is not mine]
    conflicts = [
        (entry, path)
        for entry, theirs in others
        for path in sorted(owned & theirs)
        if not _same(value_at(current, path), value_at(config, path))
    ]
    if conflicts and not force:
        raise errors.apply_conflict(
            sorted(((_printed(e), "." + ".".join(p)) for e, p in conflicts), key=lambda c: c[1])
        )
    taken = {(id(entry), path) for entry, path in conflicts}
    others = [
        (entry, {path for path in theirs if (id(entry), path) not in taken})
        for entry, theirs in others
    ]
    merged = copy.deepcopy(current)
    for path, value in applied_fields(config):
        _set(merged, path, value)
    previously = _owned(mine) if mine is not None else set()
    still_owned = set().union(*(theirs for _, theirs in others))
    for path in previously - owned - still_owned:
        _remove(merged, path)
    merged["metadata"]["resourceVersion"] = (config.get("metadata") or {}).get(
        "resourceVersion", current["metadata"]["resourceVersion"]
    )

    unchanged = previously == owned and _without_managed(merged) == _without_managed(current)
    entry = mine if unchanged else apply_entry(manager, api_version, owned, time)
    managed: list[Object] = []
    for other, theirs in others:
        if theirs:
            managed.append(other if theirs == _owned(other) else _with_owned(other, theirs))
    if owned and entry is not None:
        position = entries.index(mine) if mine is not None else len(managed)
        managed.insert(min(position, len(managed)), entry)
    if managed:
        merged["metadata"]["managedFields"] = managed
    else:
        merged["metadata"].pop("managedFields", None)
    return merged


def _without_managed(obj: Object) -> Object:
    return {**obj, "metadata": {k: v for k, v in obj["metadata"].items() if k != "managedFields"}}


# Other writes.


def sent_on_create(sent: Any) -> list[Object] | None:
    """The managedFields a create keeps from its body: entries that name a manager."""
    if not isinstance(sent, list):
        return None
    return [entry for entry in sent if isinstance(entry, dict) and entry.get("manager")] or None


def after_update(sent: Any, current: Object, updated: Object) -> list[Object] | None:
    """The managedFields after a write that is not an apply.

    A body that carries managedFields different from the stored ones sets them (``[{}]``
    resets them); one without them keeps the stored ones. Either way, whoever owned a
    field this write changed no longer owns it.
    """
    live = [e for e in current["metadata"].get("managedFields") or [] if isinstance(e, dict)]
    if isinstance(sent, list) and sent and sent != live:
        return sent_on_create(sent)
    kept: list[Object] = []
    for entry in live:
        owned = _owned(entry)
        still = {p for p in owned if _same(value_at(current, p), value_at(updated, p))}
        if still == owned:
            kept.append(entry)
        elif still:
            kept.append(_with_owned(entry, still))
    return kept or None
