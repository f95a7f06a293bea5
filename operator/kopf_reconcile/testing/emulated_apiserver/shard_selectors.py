"""Shard selectors (KEP-5866, ``ShardedListAndWatch``), parsed and matched as kube-apiserver
v1.37 does for list and watch.

``shardSelector=shardRange(object.metadata.uid, '0x0000000000000000', '0x8000000000000000')``,
several ranges joined by ``||``, all over one field: ``object.metadata.uid`` or
``object.metadata.namespace``. An object matches when the 64-bit FNV-1a hash of that field's
value (its UTF-8 bytes), as 16 lowercase hex digits, lies in ``[start, end)`` of any range;
bounds are ``0x`` and exactly 16 lowercase hex digits, or ``0x10000000000000000`` (2^64) as
the end of the space. A list answers ``metadata.shardInfo.selector`` with the selector in its
canonical form (``shardRange(<field>, '<start>', '<end>')`` joined by `` || ``), so a client
can tell a filtered list from a full one; except a list of custom resources, which v1.37
filters all the same but answers without ``shardInfo`` (its unstructured list type has no
such field). An empty parameter filters nothing; a bad one is
answered as the real server answers it: 500, ``invalid shard selector: ...``. With the
feature off (:class:`~.server.ApiServer`'s ``sharded_list_and_watch``), the parameter is
ignored, as by a server without the gate.

The real server parses the expression with CEL and walks its syntax tree; this module reads
the subset that tree may hold (identifiers joined by ``.``, string literals in single or
double quotes, calls, ``||``, ``&&`` and parentheses) and words the refusals of v1.37's walker.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from kopf_reconcile.sharding import fnv1a_64
from kopf_reconcile.testing.emulated_apiserver import errors

__all__ = ["ShardSelector", "parse_shard_selector"]

FIELDS = {
    "object.metadata.uid": "uid",
    "object.metadata.namespace": "namespace",
}
SPACE_END = "0x10000000000000000"  # 2^64, the exclusive end of the hash space

_TOKEN = re.compile(
    r"""\s*(?:
        (?P<string>'(?:[^'\\\n]|\\.)*'|"(?:[^"\\\n]|\\.)*")
      | (?P<or>\|\|)
      | (?P<and>&&)
      | (?P<punct>[(),.])
      | (?P<ident>[A-Za-z_][A-Za-z0-9_]*)
      | (?P<other>\S+?)
    )""",
    re.VERBOSE,
)


@dataclasses.dataclass(frozen=True)
class ShardRange:
    key: str  # the field path
    start: str  # 0x + 16 hex digits, inclusive
    end: str  # 0x + 16 hex digits or SPACE_END, exclusive


@dataclasses.dataclass(frozen=True)
class ShardSelector:
    """A parsed shard selector: ranges over one field."""

    ranges: tuple[ShardRange, ...]

    def __str__(self) -> str:
        """The canonical form the server echoes in ``shardInfo.selector``."""
        return " || ".join(f"shardRange({r.key}, '{r.start}', '{r.end}')" for r in self.ranges)

    def matches(self, obj: dict[str, Any]) -> bool:
        field = FIELDS[self.ranges[0].key]
        value = str((obj.get("metadata") or {}).get(field) or "")
        hashed = f"0x{fnv1a_64(value.encode('utf-8', 'surrogatepass')):016x}"
        return any(not _hex_less(hashed, r.start) and _hex_less(hashed, r.end) for r in self.ranges)


def parse_shard_selector(text: str) -> ShardSelector | None:
    """The selector of a ``shardSelector`` parameter; None when it is empty (no filter)."""
    if text == "":
        return None
    try:
        return _parse(text)
    except _Refused as refused:
        raise errors.storage_error(f"invalid shard selector: {refused}") from None


class _Refused(Exception):
    """Why a selector is refused, worded as kube-apiserver v1.37 words it."""


def _hex_less(a: str, b: str) -> bool:
    return len(a) < len(b) if len(a) != len(b) else a < b


def _quoted(value: str) -> str:
    """Go's %q of a string (close enough for what selectors hold)."""
    return json.dumps(value, ensure_ascii=False)


# The syntax tree: ("call", name, args) | ("select", path) | ("string", value) | ("other", kind)
Node = tuple[Any, ...]


def _parse(text: str) -> ShardSelector:
    text = text.strip()
    if not text:
        raise _Refused(
            "empty shard selector is not allowed; omit the parameter for unfiltered lists"
        )
    tokens = _tokens(text)
    reader = _Reader(tokens)
    tree = reader.expression()
    if reader.position != len(tokens):
        raise _Refused("CEL parse error: Syntax error: extraneous input")
    ranges = _walk(tree)
    for later in ranges[1:]:
        if later.key != ranges[0].key:
            raise _Refused(
                f"all shard ranges must use the same field, got {_quoted(ranges[0].key)} "
                f"and {_quoted(later.key)}"
            )
    return ShardSelector(tuple(ranges))


def _tokens(text: str) -> list[tuple[str, str]]:
    found: list[tuple[str, str]] = []
    position = 0
    while position < len(text):
        match = _TOKEN.match(text, position)
        if match is None or match.end() == position:
            break
        kind = match.lastgroup or "other"
        if kind == "other":
            raise _Refused(
                f"CEL parse error: Syntax error: token recognition error at: '{match[kind]}'"
            )
        found.append((kind, match[kind]))
        position = match.end()
    return found


class _Reader:
    """A recursive-descent reader of the CEL subset a shard selector uses."""

    def __init__(self, tokens: list[tuple[str, str]]) -> None:
        self.tokens = tokens
        self.position = 0

    def _peek(self) -> tuple[str, str] | None:
        return self.tokens[self.position] if self.position < len(self.tokens) else None

    def _take(self, value: str) -> None:
        token = self._peek()
        if token is None or token[1] != value:
            raise _Refused(f"CEL parse error: Syntax error: missing '{value}'")
        self.position += 1

    def expression(self) -> Node:
        node = self._conjunction()
        while (token := self._peek()) is not None and token[0] == "or":
            self.position += 1
            node = ("call", "_||_", [node, self._conjunction()])
        return node

    def _conjunction(self) -> Node:
        node = self._primary()
        while (token := self._peek()) is not None and token[0] == "and":
            self.position += 1
            node = ("call", "_&&_", [node, self._primary()])
        return node

    def _primary(self) -> Node:
        token = self._peek()
        if token is None:
            raise _Refused("CEL parse error: Syntax error: mismatched input '<EOF>'")
        kind, value = token
        self.position += 1
        if kind == "string":
            return ("string", _unquote(value))
        if value == "(":
            node = self.expression()
            self._take(")")
            return node
        if kind != "ident":
            raise _Refused(f"CEL parse error: Syntax error: mismatched input '{value}'")
        if (following := self._peek()) is not None and following[1] == "(":
            self.position += 1
            args: list[Node] = []
            if (closing := self._peek()) is not None and closing[1] == ")":
                self.position += 1
                return ("call", value, args)
            while True:
                args.append(self.expression())
                if (sep := self._peek()) is not None and sep[1] == ",":
                    self.position += 1
                    continue
                self._take(")")
                return ("call", value, args)
        path = [value]
        while (dot := self._peek()) is not None and dot[1] == ".":
            self.position += 1
            name = self._peek()
            if name is None or name[0] != "ident":
                raise _Refused("CEL parse error: Syntax error: no viable alternative")
            self.position += 1
            path.append(name[1])
        return ("select", ".".join(path))


def _unquote(literal: str) -> str:
    body = literal[1:-1]
    return re.sub(r"\\(.)", r"\1", body)


_KINDS = {"select": "SelectKind", "string": "LiteralKind", "call": "CallKind"}


def _kind(node: Node) -> str:
    if node[0] == "select":
        return "IdentKind" if "." not in node[1] else "SelectKind"
    return _KINDS[node[0]]


def _walk(node: Node) -> list[ShardRange]:
    if node[0] != "call":
        raise _Refused(
            f"unexpected expression kind {_kind(node)}; expected shardRange() call or || operator"
        )
    _, name, args = node
    if name == "_||_":
        return _walk(args[0]) + _walk(args[1])
    if name != "shardRange":
        raise _Refused(
            f"unsupported function {_quoted(name)}; only shardRange() and || are allowed"
        )
    if len(args) != 3:
        raise _Refused(f"shardRange() requires exactly 3 arguments, got {len(args)}")
    if args[0][0] != "select":
        raise _Refused(
            "shardRange() first argument: expected field path (e.g. object.metadata.uid), "
            f"got expression kind {_kind(args[0])}"
        )
    path = args[0][1]
    if path not in FIELDS:
        raise _Refused(
            f"unsupported field path {_quoted(path)}; supported: object.metadata.uid, "
            "object.metadata.namespace"
        )
    start, end = _hex(args[1], "hexStart"), _hex(args[2], "hexEnd")
    if not _hex_less(start, end):
        raise _Refused(f"shard range start {start} must be less than end {end}")
    return [ShardRange(path, start, end)]


def _hex(node: Node, name: str) -> str:
    if node[0] != "string":
        raise _Refused(
            f"{name} must be a string literal (e.g. '0xff'), got expression kind {_kind(node)}"
        )
    value: str = node[1]
    if not value.startswith("0x"):
        raise _Refused(f"{name} must have '0x' prefix, got {_quoted(value)}")
    digits = value[2:]
    if not digits:
        raise _Refused(f"{name}: hex value is required after '0x'")
    if len(digits) > 17:
        raise _Refused(
            f"{name}: hex value too long ({len(digits)} chars, max 17): {_quoted(digits)}"
        )
    for char in digits:
        if char not in "0123456789abcdef":
            raise _Refused(f"{name}: invalid hex character {_quoted(char)} in {_quoted(value)}")
    if len(digits) == 17:
        if value != SPACE_END:
            raise _Refused(
                f"{name}: 17-digit hex value must be '{SPACE_END}' (2^64), got {_quoted(value)}"
            )
    elif len(digits) != 16:
        padded = "0x" + "0" * (16 - len(digits)) + digits
        raise _Refused(
            f"{name} must be a 0x-prefixed 16-digit hex value, got {_quoted(value)} "
            f"(did you mean {_quoted(padded)}?)"
        )
    return value
