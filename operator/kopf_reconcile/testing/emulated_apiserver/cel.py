"""CEL for admission policies, on the ``cel-python`` package (``celpy``).

Expressions are compiled once (:func:`compile_expression`, cached by text) and evaluated
against an activation of plain JSON values converted to CEL values. What kube-apiserver's
cel-go answers differently, and how it is bridged here:

* errors are worded as cel-go words them where a policy's message shows them (a missing
  map key or field: ``no such key: <key>``; a field of ``null``: ``no such key``);
* the lazily evaluated ``variables`` of a policy are a map whose entries are computed on
  first use (:class:`LazyVariables`), as kube-apiserver composes them, so a variable that
  fails fails only the expressions that use it.

``has()`` on maps, ``in`` on maps, ``string(int)``, the ternary, ``matches``,
``startsWith`` and the macros (``all``, ``exists``, ``map``, ``filter``) work as in cel-go.
The Kubernetes CEL libraries (``quantity``, ``url``, ``ip``, ``authorizer``...) are not
available: an expression using them fails to compile.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from functools import lru_cache
from typing import Any

import celpy
from celpy import celtypes
from celpy.adapter import json_to_cel
from celpy.celparser import CELParseError
from celpy.evaluation import CELEvalError

#: ``celpy`` words a missing key as this; cel-go as ``no such key: <key>``.
_MISSING_MEMBER = re.compile(r"no such member in mapping: '(?P<key>.*)'")
_NULL_SELECTION = re.compile(r"None with type: .* does not support field selection")

_ENVIRONMENT = celpy.Environment()


class CelError(Exception):
    """A CEL expression failed to compile or to evaluate; the message is cel-go's wording."""


class Program:
    """One compiled expression."""

    def __init__(self, expression: str) -> None:
        self.expression = expression
        try:
            self._runner = _ENVIRONMENT.program(_ENVIRONMENT.compile(expression))
        except CELParseError as error:
            raise CelError(f"compilation failed: {error}") from None

    def evaluate(self, activation: Mapping[str, Any]) -> Any:
        """The value of the expression (a CEL value), or :class:`CelError`."""
        try:
            result = self._runner.evaluate(dict(activation))
        except CELEvalError as error:
            raise CelError(_cel_go_words(error)) from None
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as error:
            raise CelError(str(error)) from None
        if isinstance(result, CELEvalError):
            raise CelError(_cel_go_words(result))
        return result


@lru_cache(maxsize=1024)
def compile_expression(expression: str) -> Program:
    """The compiled expression (compiled once per text); raises :class:`CelError`."""
    return Program(expression)


def to_cel(value: Any) -> Any:
    """A JSON value as a CEL value (``None`` stays CEL's ``null``)."""
    return json_to_cel(value)


def to_python(value: Any) -> Any:
    """A CEL value as plain Python (for messages: strings stay strings)."""
    if isinstance(value, celtypes.BoolType):
        return bool(value)
    if isinstance(value, celtypes.StringType):
        return str(value)
    return value


class LazyVariables(celtypes.MapType):
    """``variables``: each computed once, on first use, from the ones before it."""

    def __init__(self, thunks: Mapping[str, Callable[[], Any]]) -> None:
        super().__init__()
        self._thunks = thunks
        self._values: dict[str, Any] = {}

    def __getitem__(self, key: Any) -> Any:
        name = str(key)
        if name not in self._values:
            thunk = self._thunks.get(name)
            if thunk is None:
                raise KeyError(name)
            self._values[name] = thunk()
        return self._values[name]

    def __contains__(self, key: object) -> bool:
        return str(key) in self._thunks


def _cel_go_words(error: CELEvalError) -> str:
    text = str(error.args[0]) if error.args else str(error)
    missing = _MISSING_MEMBER.fullmatch(text)
    if missing is not None:
        return f"no such key: {missing['key']}"
    if _NULL_SELECTION.fullmatch(text):
        return "no such key"
    return text
