"""Log output: secrets redacted everywhere in a record, JSON and text formats, kopf quieted."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from kopf_reconcile import ConfigError
from kopf_reconcile.database import redact_dsn
from kopf_reconcile.integration import logs
from kopf_reconcile.integration.settings import Settings

PASSWORD = "s3cr@t-Pw"
TOKEN = "eyJhbGciOiJSUzI1NiJ9.payload.signature"
DSN = f"postgresql://app:{PASSWORD}@db.example:5432/app"


@pytest.mark.parametrize(
    ("text", "secret"),
    [
        (f"connecting to {DSN}", PASSWORD),
        (f"dsn='{DSN}'", PASSWORD),
        ("host=db user=app password=hunter2 dbname=app", "hunter2"),
        ("postgresql://db/app?user=app&password=hunter2&sslmode=require", "hunter2"),
        (f"Authorization: Bearer {TOKEN}", TOKEN),
        (f"headers={{'Authorization': 'Basic {TOKEN}'}}", TOKEN),
        (f'{{"authorization": "Bearer {TOKEN}"}}', TOKEN),
        (f"token is bearer {TOKEN} here", TOKEN),
    ],
)
def test_redact(text: str, secret: str) -> None:
    redacted = logs.redact(text)
    assert secret not in redacted
    assert logs.REDACTED in redacted


def test_redact_keeps_harmless_text() -> None:
    text = "GET http://127.0.0.1:8080/metrics?x=a@b from user@example.com: 200"
    assert logs.redact("reconciled default/device-1 at epoch 3") == (
        "reconciled default/device-1 at epoch 3"
    )
    assert "127.0.0.1" in logs.redact(text)
    assert "postgresql://app:***@db.example:5432/app" in logs.redact(DSN)


@pytest.fixture
def captured() -> Iterator[tuple[logging.Logger, io.StringIO]]:
    """A logger whose records go through the redaction filter into a string."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logs.TextFormatter())
    handler.addFilter(logs.RedactingFilter())
    logger = logging.getLogger("test_logs.captured")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    yield logger, stream
    logger.removeHandler(handler)


def test_filter_redacts_message_arguments_extras_and_exceptions(
    captured: tuple[logging.Logger, io.StringIO],
) -> None:
    logger, stream = captured
    logger.info("connecting to %s with %r", DSN, {"Authorization": f"Bearer {TOKEN}"})
    logger.info("dsn in an extra", extra={"dsn": DSN})
    try:
        raise ConnectionError(f"could not connect to {DSN} (Authorization: Bearer {TOKEN})")
    except ConnectionError:
        logger.exception("connection failed")
    logger.warning("stack", stack_info=True, extra={"note": f"Bearer {TOKEN}"})
    output = stream.getvalue()
    assert PASSWORD not in output
    assert TOKEN not in output
    assert "ConnectionError: could not connect to postgresql://app:***@db.example" in output
    assert output.count("***") >= 4


def test_filter_survives_a_bad_format_string(captured: tuple[logging.Logger, io.StringIO]) -> None:
    logger, stream = captured
    logger.info("%s and %s", DSN)  # noqa: PLE1206 - one argument short, on purpose
    assert PASSWORD not in stream.getvalue()
    assert "app:***@db" in stream.getvalue()


def _record(**extra: object) -> logging.LogRecord:
    record = logging.LogRecord("kopf.objects", logging.INFO, __file__, 1, "msg %s", ("x",), None)
    record.__dict__.update(extra)
    return record


def test_json_format_is_one_object_per_line() -> None:
    record = _record(
        k8s_ref={"namespace": "ns", "name": "dev-1", "kind": "Device"},
        controller="reconcile_device",
        epoch=3,
    )
    document = json.loads(logs.JsonFormatter().format(record))
    assert document["message"] == "msg x"
    assert document["level"] == "INFO"
    assert document["logger"] == "kopf.objects"
    assert document["object"] == "ns/dev-1"
    assert document["controller"] == "reconcile_device"
    assert document["epoch"] == 3
    assert "k8s_ref" not in document
    assert document["time"].endswith("+00:00")


def test_json_format_carries_the_exception() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        import sys

        record = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed", None, sys.exc_info())
    document = json.loads(logs.JsonFormatter().format(record))
    assert "ValueError: boom" in document["exception"]


def test_text_format_names_the_object() -> None:
    text = logs.TextFormatter().format(_record(k8s_ref={"namespace": "ns", "name": "dev-1"}))
    assert "INFO    kopf.objects [ns/dev-1]: msg x" in text


@pytest.mark.parametrize(
    ("level", "message", "kept"),
    [
        (logging.INFO, "Handler 'kopf-reconcile/reconcile-device/events' succeeded.", False),
        (logging.INFO, "Handler 'my-own-handler' succeeded.", True),
        (logging.ERROR, "Handler 'kopf-reconcile/reconcile-device/events' failed: x", True),
        (logging.WARNING, "Handler 'kopf-reconcile/x/events' succeeded.", True),
    ],
)
def test_quiet_event_handlers(level: int, message: str, kept: bool) -> None:
    record = logging.LogRecord("kopf.objects", level, __file__, 1, message, None, None)
    assert logs.QuietEventHandlers().filter(record) is kept


def test_configure_installs_json_output_and_redaction() -> None:
    root = logging.getLogger()
    saved_handlers, saved_level = root.handlers[:], root.level
    objects = logging.getLogger("kopf.objects")
    saved_filters = objects.filters[:]
    stream = io.StringIO()
    try:
        logs.configure("json", "INFO", stream=stream)
        logs.configure("json", "INFO", stream=stream)  # idempotent: one handler, one line
        logging.getLogger("test_logs.configured").info("dsn %s", DSN)
        objects.info("Handler 'kopf-reconcile/r/events' succeeded.")
        lines = stream.getvalue().splitlines()
        assert len(lines) == 1
        assert json.loads(lines[0])["message"] == "dsn postgresql://app:***@db.example:5432/app"
        assert any(isinstance(f, logs.RedactingFilter) for f in objects.filters)
    finally:
        root.handlers[:] = saved_handlers
        root.setLevel(saved_level)
        objects.filters[:] = saved_filters


def test_configure_rejects_an_unknown_format() -> None:
    with pytest.raises(ValueError, match="log format"):
        logs.configure("xml")


SECRET = "s3cr3tXYZ"


@pytest.mark.parametrize(
    "text",
    [
        f"headers=[('Authorization', 'Basic {SECRET}')]",
        f"host=db sslpassword={SECRET} dbname=x",
        f"PGPASSWORD={SECRET}",
        f"connect kwargs {{'user': 'u', 'password': '{SECRET}'}}",
        f'{{"user": "u", "password": "{SECRET}"}}',
        f"postgresql://user:ab/{SECRET}@db:5432/x",
        f"postgresql://user:ab#{SECRET}@db:5432/x",
        f"postgresql://user:ab?{SECRET}@db:5432/x",
        f"postgresql://u:{SECRET}@[db:5432/x",
    ],
)
def test_secrets_in_every_rendering_are_redacted(text: str) -> None:
    assert SECRET not in logs.redact(text)
    assert SECRET not in redact_dsn(text)


def test_a_repository_repr_never_shows_the_password() -> None:
    from kopf_reconcile.fencing.postgres import PostgresFencedRepository

    assert SECRET not in repr(PostgresFencedRepository(f"postgresql://user:ab#{SECRET}@db/x"))


def test_a_malformed_database_url_is_a_config_error_naming_the_variable() -> None:
    url = f"postgresql://u:{SECRET}@[db:5432/x"
    with pytest.raises(ConfigError, match=r"^KOPF_RECONCILE_DATABASE_URL must be") as raised:
        Settings.load({"KOPF_RECONCILE_DATABASE_URL": url})
    assert SECRET not in str(raised.value)
