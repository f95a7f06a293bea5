"""Log output of an operator process: JSON or text lines, secrets redacted, kopf quieted.

Redaction. Operators log URLs, request details and exceptions, and any of them
can carry a secret: the password of a database URL, a bearer token, an
``Authorization`` header. :class:`RedactingFilter` rewrites every record that
passes through it before any handler formats it: the message with its
arguments, the exception and stack text, and string-valued extra fields.
:func:`configure` installs it on every handler of the root logger and on kopf's
per-object logger, whose records kopf also posts to the cluster as Events.

Quieting. kopf logs an INFO line under ``kopf.objects`` for every successful
call of an ``on.event`` handler; the kopf shim's handler runs for every watch
event, so :class:`QuietEventHandlers` drops exactly those lines (the shim's
handlers, INFO, "succeeded") and keeps everything else, failures included.
"""

from __future__ import annotations

import datetime
import json
import logging
import re
import sys
from typing import Any, TextIO

from kopf_reconcile.redaction import REDACTED, redact

__all__ = [
    "EVENT_HANDLER_PREFIX",
    "REDACTED",
    "JsonFormatter",
    "QuietEventHandlers",
    "RedactingFilter",
    "TextFormatter",
    "configure",
    "redact",
]

#: Id prefix of the kopf handlers the shim registers (see kopf_shim).
EVENT_HANDLER_PREFIX = "kopf-reconcile/"

# Attributes every LogRecord has; anything else was passed as an extra.
_RECORD_ATTRIBUTES = frozenset(
    logging.LogRecord("", 0, "", 0, "", None, None).__dict__.keys() | {"message", "asctime"}
)


class RedactingFilter(logging.Filter):
    """Rewrites a record so that no secret reaches a handler; never drops a record."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a bad format string: keep its parts, redacted
            message = f"{record.msg!r} % {record.args!r}"
        record.msg = redact(message)
        record.args = None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        if record.stack_info:
            record.stack_info = redact(record.stack_info)
        for name, value in list(record.__dict__.items()):
            if name not in _RECORD_ATTRIBUTES and isinstance(value, str):
                setattr(record, name, redact(value))
        return True


class QuietEventHandlers(logging.Filter):
    """Drops kopf's per-event "Handler 'kopf-reconcile/…' succeeded." INFO lines."""

    _SUCCEEDED = re.compile(rf"^Handler '{re.escape(EVENT_HANDLER_PREFIX)}[^']*' succeeded\.$")

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.INFO or not isinstance(record.msg, str):
            return True
        return self._SUCCEEDED.match(record.msg) is None


def install_quiet_event_handlers() -> None:
    """Quiet the shim's per-event lines on kopf's object logger (idempotent)."""
    objects = logging.getLogger("kopf.objects")
    if not any(isinstance(f, QuietEventHandlers) for f in objects.filters):
        objects.addFilter(QuietEventHandlers())


def _object_of(record: logging.LogRecord) -> str | None:
    """``namespace/name`` (or ``name``) of the object a kopf per-object record is about."""
    ref = getattr(record, "k8s_ref", None)
    if not isinstance(ref, dict) or not ref.get("name"):
        return None
    namespace = ref.get("namespace")
    return f"{namespace}/{ref['name']}" if namespace else str(ref["name"])


class TextFormatter(logging.Formatter):
    """``time LEVEL logger [object]: message``, then the exception text if any."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s%(object)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        obj = _object_of(record)
        record.object = f" [{obj}]" if obj else ""
        return super().format(record)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, object, extras, exception."""

    def format(self, record: logging.LogRecord) -> str:
        document: dict[str, Any] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        obj = _object_of(record)
        if obj:
            document["object"] = obj
        for name, value in record.__dict__.items():
            if name in _RECORD_ATTRIBUTES or name.startswith("k8s_") or name in document:
                continue
            if isinstance(value, str | int | float | bool) or value is None:
                document[name] = value
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            document["exception"] = record.exc_text
        if record.stack_info:
            document["stack"] = record.stack_info
        return json.dumps(document, default=str)


class _OperatorStreamHandler(logging.StreamHandler[TextIO]):
    """The handler :func:`configure` installs (recognised to replace it on reconfiguration)."""


def configure(
    log_format: str = "text",
    level: str | int = "INFO",
    stream: TextIO | None = None,
) -> None:
    """Log to ``stream`` (stderr) in ``log_format`` at ``level``, secrets redacted.

    Replaces a previous configuration of this function, keeps other handlers
    but adds the redaction filter to them too, and quiets the per-event lines.
    """
    if log_format not in ("text", "json"):
        raise ValueError(f"log format must be 'text' or 'json', got {log_format!r}")
    handler = _OperatorStreamHandler(sys.stderr if stream is None else stream)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [h for h in root.handlers if not isinstance(h, _OperatorStreamHandler)]
    root.addHandler(handler)
    root.setLevel(level)
    # Filters on handlers see records propagated from every logger; a logger's own
    # filter is needed for kopf.objects, whose Event-posting handler sits there.
    for target in (*root.handlers, logging.getLogger("kopf.objects")):
        if not any(isinstance(f, RedactingFilter) for f in target.filters):
            target.addFilter(RedactingFilter())
    # asyncio's debug chatter is not the operator's business unless debugging.
    debugging = level in ("DEBUG", logging.DEBUG)
    logging.getLogger("asyncio").setLevel(logging.DEBUG if debugging else logging.WARNING)
    install_quiet_event_handlers()
