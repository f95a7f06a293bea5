"""Every use of kopf's private internals, in one module.

kopf publishes its decorators, ``kopf.operator``, the registries and the settings; the
shim (:mod:`kopf_reconcile.integration.kopf_shim`) needs four things it does not:

* the watch stream of a resource, ``kopf._cogs.clients.watching.infinite_watch``, and
  its end-of-listing marker ``Bookmark.LISTED``: the shim wraps the function to take
  every event straight from the stream and to sweep what a relist no longer holds
  (:func:`infinite_watch`, :func:`replace_infinite_watch`);
* the list of a registry's activity handlers (``registry._activities._handlers``), to
  run a reconciler's cleanup before the user's (:func:`activity_handlers`);
* the registries of resource handlers (``registry._indexing``, ``_watching``,
  ``_spawning``, ``_changing``, ``_webhooks``, each's ``get_all_handlers()``), to tell
  whether kopf itself must see a resource's events (:func:`resource_handlers`);
* kopf's own namespace matching (``kopf._cogs.structs.references.match_namespace``),
  for readiness to watch exactly the namespaces kopf watches (:func:`match_namespace`);
* how its list and watch read ``settings.watching.shard_selectors`` (``collect(resource)``,
  the first value used), to give one stream a KEP-5866 selector of its own
  (:func:`shard_selector_of`, :func:`with_shard_selector`).

``pyproject.toml`` admits only the kopf releases the suite has run against (1.45.2 and
its patch releases), and ``tests/unit/test_kopf_internals.py`` fails when one of these
changes its shape (:func:`shape_problems`): the wrapped function's parameters, the
marker, the registries. At run time a missing piece is logged and the shim does without
it (see each caller), never guessed.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from collections.abc import Callable, Collection
from typing import Any

__all__ = [
    "INFINITE_WATCH_PARAMETERS",
    "RESOURCE_REGISTRIES",
    "activity_handlers",
    "infinite_watch",
    "match_namespace",
    "replace_infinite_watch",
    "resource_handlers",
    "shape_problems",
    "shard_selector_of",
    "with_shard_selector",
]

# The keyword parameters of kopf's infinite_watch the shim's wrapper passes on as they are.
INFINITE_WATCH_PARAMETERS = ("settings", "resource", "namespace", "operator_paused", "_iterations")

# kopf's registries of resource handlers: any handler there other than the shim's own
# needs kopf to see the resource's events.
RESOURCE_REGISTRIES = ("_indexing", "_watching", "_spawning", "_changing", "_webhooks")


def _watching() -> Any:
    """kopf's watch-stream module, or None when it is not where it was."""
    with contextlib.suppress(ImportError):
        from kopf._cogs.clients import watching

        return watching
    return None


def infinite_watch() -> tuple[Callable[..., Any], object] | None:
    """kopf's ``infinite_watch`` as it is now (maybe already wrapped) and its listing
    marker (``Bookmark.LISTED``); None when this kopf has not both."""
    watching = _watching()
    original = getattr(watching, "infinite_watch", None)
    listed_marker = getattr(getattr(watching, "Bookmark", None), "LISTED", None)
    if original is None or listed_marker is None:
        return None
    return original, listed_marker


def replace_infinite_watch(wrapper: Callable[..., Any], original: Callable[..., Any]) -> None:
    """Make kopf's watcher read its streams from ``wrapper`` of ``original`` (its module is
    read at every start of a stream, so every stream started from now on goes through it).

    The wrapper is marked as the shim's (``_kopf_reconcile_sweeps``: never wrapped twice)
    and keeps the function it wraps (``_kopf_original``: its shape is what is checked).
    """
    wrapper._kopf_reconcile_sweeps = True  # type: ignore[attr-defined]
    wrapper._kopf_original = original  # type: ignore[attr-defined]
    _watching().infinite_watch = wrapper


def activity_handlers(registry: Any) -> list[Any] | None:
    """The registry's activity handlers (startup, cleanup, probes), in kopf's own list:
    sorted in place, it changes the order kopf runs them in. None when not a list."""
    handlers = getattr(getattr(registry, "_activities", None), "_handlers", None)
    return handlers if isinstance(handlers, list) else None


def resource_handlers(registry: Any) -> list[Collection[Any]] | None:
    """The registry's resource handlers, one collection per kind of handler; None when one
    of kopf's registries of resource handlers is not there."""
    found: list[Collection[Any]] = []
    for name in RESOURCE_REGISTRIES:
        handlers = getattr(registry, name, None)
        if handlers is None:
            return None
        found.append(handlers.get_all_handlers())
    return found


def match_namespace(name: str, pattern: str) -> bool:
    """Whether kopf watches namespace ``name`` for ``pattern`` (globs, ``!`` negations)."""
    from kopf._cogs.structs import references

    return bool(references.match_namespace(references.NamespaceName(name), pattern))


def shape_problems() -> list[str]:
    """What of kopf's internals used here is not shaped as this module expects (empty
    when everything is): for a test to fail on, naming each."""
    problems: list[str] = []
    found = infinite_watch()
    if found is None:
        problems.append("kopf._cogs.clients.watching: no infinite_watch or Bookmark.LISTED")
    else:
        function = getattr(found[0], "_kopf_original", found[0])
        parameters = tuple(inspect.signature(function).parameters)
        if parameters != INFINITE_WATCH_PARAMETERS:
            problems.append(
                f"kopf's infinite_watch takes {parameters}, not {INFINITE_WATCH_PARAMETERS}"
            )
    from kopf._cogs.clients import fetching, watching

    for function in (fetching.fetch_objs, watching.watch_objs):
        if "shard_selectors.collect(resource)" not in inspect.getsource(function):
            problems.append(f"kopf's {function.__name__} does not read shard_selectors.collect")
    import kopf

    registry = kopf.OperatorRegistry()
    if activity_handlers(registry) is None:
        problems.append("kopf's OperatorRegistry has no list at _activities._handlers")
    if resource_handlers(registry) is None:
        problems.append(f"kopf's OperatorRegistry lacks one of {RESOURCE_REGISTRIES}")
    try:
        if not match_namespace("team-a", "team-*") or match_namespace("team-a", "!team-*"):
            problems.append("kopf's match_namespace no longer matches globs and negations")
    except (ImportError, AttributeError, TypeError) as exc:
        problems.append(f"kopf's match_namespace cannot be called: {exc!r}")
    return problems


def shard_selector_of(settings: Any, resource: Any) -> str:
    """The ``shardSelector`` kopf's list and watch of ``resource`` send ('' for none)."""
    found = settings.watching.shard_selectors.collect(resource)
    return str(found[0]) if found else ""


class _OneSelector:
    """Stands for kopf's ``SelectorMapping`` of shard selectors: one value for every resource
    (the settings it is in serve one stream)."""

    def __init__(self, selector: str) -> None:
        self._selector = selector

    def collect(self, resource: Any) -> list[str]:
        return [self._selector]


def with_shard_selector(settings: Any, selector: str) -> Any:
    """A copy of kopf's ``settings`` whose lists and watches send ``selector`` (for one stream)."""
    copied = copy.copy(settings)
    copied.watching = copy.copy(settings.watching)
    copied.watching.shard_selectors = _OneSelector(selector)
    return copied
