"""Client-side selection: which objects of a resource a reconciler takes as its own.

``@kr.reconciler(labels=..., field_selector=...)`` selects objects on the client side: exact
label values, and a Kubernetes field selector (``metadata.name=x,status.phase!=Done``: terms
of ``=``, ``==`` or ``!=`` joined by commas, over dotted paths of the body). An object that
stops matching looks deleted to the reconciler, as a watch with a selector reports it; one
it never selected never reaches it (see :mod:`kopf_reconcile.integration.kopf_shim`). A field
that is absent compares as the empty string; booleans as ``true`` and ``false``, as the API
server writes them.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from kopf_reconcile.api import ConfigError

__all__ = ["Selection"]


@dataclasses.dataclass(frozen=True)
class Selection:
    """Client-side object selection: exact labels and a Kubernetes field selector."""

    labels: Mapping[str, str]
    fields: tuple[tuple[tuple[str, ...], str, bool], ...]  # (path, value, equal)

    _TERM = re.compile(r"^\s*([A-Za-z0-9_.-]+)\s*(==|!=|=)\s*(.*?)\s*$")

    @classmethod
    def parse(cls, labels: Mapping[str, str] | None, field_selector: str | None) -> Selection:
        if labels is not None and (
            not isinstance(labels, Mapping)
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items())
        ):
            raise ConfigError(f"labels must be a mapping of label names to values, got {labels!r}")
        fields: list[tuple[tuple[str, ...], str, bool]] = []
        if field_selector is not None:
            if not isinstance(field_selector, str):
                raise ConfigError(f"field_selector must be a string, got {field_selector!r}")
            for term in filter(None, (t.strip() for t in field_selector.split(","))):
                match = cls._TERM.match(term)
                if match is None:
                    raise ConfigError(
                        f"field_selector term {term!r} is not <field>=<value>, <field>==<value> "
                        f"or <field>!=<value> (in {field_selector!r})"
                    )
                path, operator, value = match.groups()
                fields.append((tuple(path.split(".")), value, operator != "!="))
        return cls(dict(labels or {}), tuple(fields))

    def matches(self, body: Mapping[str, Any]) -> bool:
        metadata = body.get("metadata") or {}
        present = metadata.get("labels") or {}
        if any(present.get(k) != v for k, v in self.labels.items()):
            return False
        return all((_field(body, path) == value) is equal for path, value, equal in self.fields)


def _field(body: Mapping[str, Any], path: tuple[str, ...]) -> str:
    value: Any = body
    for key in path:
        value = value.get(key) if isinstance(value, Mapping) else None
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
