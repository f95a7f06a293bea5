"""Protobuf request bodies of the built-in kinds kubectl creates imperatively.

kubectl (1.35) sends ``kubectl create configmap|secret|namespace`` as
``application/vnd.kubernetes.protobuf`` and does not fall back to JSON when it gets 415,
so the emulation decodes those bodies; every answer stays JSON (kubectl also accepts
``application/json``, and decodes by the answer's content type).

The wire format (``k8s.io/apimachinery``'s ``runtime.Unknown`` envelope and the
``generated.proto`` messages of ``k8s.io/api/core/v1``), decoded by hand, since only a
few fields of four messages are needed:

* the body is the magic ``k8s\\x00`` then ``Unknown``: ``typeMeta`` (1: ``apiVersion`` 1,
  ``kind`` 2), ``raw`` (2: the object's message), ``contentEncoding`` (3),
  ``contentType`` (4);
* ``ObjectMeta``: ``name`` 1, ``generateName`` 2, ``namespace`` 3, ``labels`` 11,
  ``annotations`` 12, ``finalizers`` 14; the server-owned fields (4-10, 15, 17:
  ``uid``, ``resourceVersion``, timestamps, ``managedFields``...) are read and dropped,
  as the server ignores them in a create anyway;
* ``ConfigMap``: ``metadata`` 1, ``data`` 2 (map of strings), ``binaryData`` 3 (map of
  bytes), ``immutable`` 4; ``Secret``: ``metadata`` 1, ``data`` 2 (bytes), ``type`` 3,
  ``stringData`` 4, ``immutable`` 5; ``Namespace``: ``metadata`` 1, ``spec`` 2
  (``finalizers`` 1), ``status`` 3 (ignored: the server sets it).

Maps are repeated entries (``key`` 1, ``value`` 2). gogo-protobuf writes optional
strings even when empty (``12 00``); as in JSON's ``omitempty``, an empty value is
absent. Bytes become base64 text, as JSON carries them. Anything else (another kind,
an owner reference, a field this module does not know) is answered 415, naming it:
send JSON instead.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Iterator
from typing import Any

from kopf_reconcile.testing.emulated_apiserver import errors

__all__ = ["MEDIA_TYPE", "decode"]

MEDIA_TYPE = "application/vnd.kubernetes.protobuf"
_MAGIC = b"k8s\x00"
_VARINT, _LENGTH_DELIMITED = 0, 2

Field = tuple[int, int, int | bytes]  # number, wire type, value


def decode(raw: bytes) -> dict[str, Any]:
    """The JSON form of a protobuf-encoded ConfigMap, Secret or Namespace."""
    if not raw.startswith(_MAGIC):
        raise _unsupported("the body does not start with the k8s protobuf magic number")
    api_version = kind = ""
    payload = b""
    for number, _, value in _fields(raw[len(_MAGIC) :], "Unknown"):
        if number == 1:
            for inner, _, text in _fields(_bytes(value), "TypeMeta"):
                if inner == 1:
                    api_version = _text(text)
                elif inner == 2:
                    kind = _text(text)
        elif number == 2:
            payload = _bytes(value)
        elif number == 3 and _bytes(value):
            raise _unsupported(f"content encoding {_text(value)!r}")
    decoder = _KINDS.get((api_version, kind))
    if decoder is None:
        raise _unsupported(f"kind {kind or '(none)'} of {api_version or '(no version)'}")
    return {"apiVersion": api_version, "kind": kind, **decoder(payload)}


def _config_map(raw: bytes) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for number, _, value in _fields(raw, "ConfigMap"):
        if number == 1:
            obj["metadata"] = _metadata(_bytes(value))
        elif number == 2:
            _map_entry(obj.setdefault("data", {}), value, _text)
        elif number == 3:
            _map_entry(obj.setdefault("binaryData", {}), value, _base64)
        elif number == 4:
            obj["immutable"] = bool(value)
        else:
            raise _unknown("ConfigMap", number)
    return obj


def _secret(raw: bytes) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for number, _, value in _fields(raw, "Secret"):
        if number == 1:
            obj["metadata"] = _metadata(_bytes(value))
        elif number == 2:
            _map_entry(obj.setdefault("data", {}), value, _base64)
        elif number == 3:
            if _bytes(value):
                obj["type"] = _text(value)
        elif number == 4:
            _map_entry(obj.setdefault("stringData", {}), value, _text)
        elif number == 5:
            obj["immutable"] = bool(value)
        else:
            raise _unknown("Secret", number)
    return obj


def _namespace(raw: bytes) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for number, _, value in _fields(raw, "Namespace"):
        if number == 1:
            obj["metadata"] = _metadata(_bytes(value))
        elif number == 2:
            finalizers = [
                _text(text) for inner, _, text in _fields(_bytes(value), "NamespaceSpec")
                if inner == 1
            ]  # fmt: skip
            obj["spec"] = {"finalizers": finalizers} if finalizers else {}
        elif number != 3:  # the status is the server's
            raise _unknown("Namespace", number)
    return obj


_KINDS: dict[tuple[str, str], Callable[[bytes], dict[str, Any]]] = {
    ("v1", "ConfigMap"): _config_map,
    ("v1", "Secret"): _secret,
    ("v1", "Namespace"): _namespace,
}
_STRINGS = {1: "name", 2: "generateName", 3: "namespace"}
_SERVER_OWNED = frozenset({4, 5, 6, 7, 8, 9, 10, 15, 17})


def _metadata(raw: bytes) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    for number, _, value in _fields(raw, "ObjectMeta"):
        if number in _STRINGS:
            if _bytes(value):
                meta[_STRINGS[number]] = _text(value)
        elif number == 11:
            _map_entry(meta.setdefault("labels", {}), value, _text)
        elif number == 12:
            _map_entry(meta.setdefault("annotations", {}), value, _text)
        elif number == 14:
            meta.setdefault("finalizers", []).append(_text(value))
        elif number not in _SERVER_OWNED:
            raise _unknown("ObjectMeta", number)
    return meta


def _map_entry(into: dict[str, Any], entry: int | bytes, convert: Callable[[Any], Any]) -> None:
    key, value = "", b""
    for number, _, item in _fields(_bytes(entry), "map entry"):
        if number == 1:
            key = _text(item)
        elif number == 2:
            value = _bytes(item)
    into[key] = convert(value)


def _fields(raw: bytes, message: str) -> Iterator[Field]:
    """The fields of one message, in wire order (varints and length-delimited only)."""
    position = 0
    while position < len(raw):
        key, position = _varint(raw, position, message)
        number, wire_type = key >> 3, key & 7
        if wire_type == _VARINT:
            value, position = _varint(raw, position, message)
            yield number, wire_type, value
        elif wire_type == _LENGTH_DELIMITED:
            length, position = _varint(raw, position, message)
            if position + length > len(raw):
                raise _malformed(message)
            yield number, wire_type, raw[position : position + length]
            position += length
        else:
            raise _unsupported(f"wire type {wire_type} in {message}")


def _varint(raw: bytes, position: int, message: str) -> tuple[int, int]:
    result = shift = 0
    while position < len(raw) and shift < 64:
        byte = raw[position]
        position += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, position
        shift += 7
    raise _malformed(message)


def _bytes(value: int | bytes) -> bytes:
    if isinstance(value, int):
        raise errors.bad_request("a protobuf field that should be length-delimited is a varint")
    return value


def _text(value: int | bytes) -> str:
    try:
        return _bytes(value).decode()
    except UnicodeDecodeError:
        raise errors.bad_request("a protobuf string is not valid UTF-8") from None


def _base64(value: bytes) -> str:
    return base64.b64encode(value).decode("ascii")


def _unknown(message: str, number: int) -> errors.ApiError:
    return _unsupported(f"field {number} of {message}")


def _malformed(message: str) -> errors.ApiError:
    return errors.bad_request(f"the protobuf body is truncated or malformed (in {message})")


def _unsupported(what: str) -> errors.ApiError:
    return errors.ApiError(
        415,
        f"the embedded cluster decodes protobuf bodies of ConfigMaps, Secrets and Namespaces "
        f"only (not {what}); send application/json",
        "UnsupportedMediaType",
    )
