"""Database passwords found by parsing, as asyncpg and libpq read a DSN, and hidden in every
output: CLI errors, the settings line ``kopf-reconcile run`` logs, log records, reprs."""

from __future__ import annotations

import contextlib
import io
import logging
import sys
from collections.abc import Iterator
from urllib.parse import quote, quote_plus

import pytest
from asyncpg import connect_utils
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kopf_reconcile import ConfigError, redaction
from kopf_reconcile.database import Database
from kopf_reconcile.integration import cli, logs
from kopf_reconcile.integration.settings import Settings
from kopf_reconcile.redaction import (
    MIN_REMEMBERED_LENGTH,
    REDACTED,
    dsn_secrets,
    redact,
    redact_dsn,
)

# Nothing listens on port 1: connecting fails at once.
HOST = "127.0.0.1:1"


@pytest.fixture(autouse=True)
def forget_remembered_secrets() -> Iterator[None]:
    """What a test remembers is hidden from its own output only, never from later tests'."""
    before = set(redaction._remembered)
    yield
    redaction._remembered.intersection_update(before)


@pytest.mark.parametrize(
    ("dsn", "secret", "shown"),
    [
        (f"postgresql://app:s3cr'etPW@{HOST}/app", "s3cr'etPW", f"postgresql://app:***@{HOST}/app"),
        (
            f'postgresql://app:s3cr"et PW@{HOST}/app',
            's3cr"et PW',
            f"postgresql://app:***@{HOST}/app",
        ),
        (f"postgresql://app:p%40ss%27w@{HOST}/app", "p@ss'w", f"postgresql://app:***@{HOST}/app"),
        (
            f"postgresql://{HOST}/app?user=app&password=hunt%27er+2&sslmode=require",
            "hunt'er 2",
            f"postgresql://{HOST}/app?user=app&password=***&sslmode=require",
        ),
        (
            f"postgresql://app@{HOST}/app?sslpassword=k3y'pass",
            "k3y'pass",
            f"postgresql://app@{HOST}/app?sslpassword=***",
        ),
        (
            f"postgresql://app@{HOST}/app?options=-c%20app.password%3Dopt-s3cret",
            "opt-s3cret",
            f"postgresql://app@{HOST}/app?options=***",
        ),
        (
            r"host=127.0.0.1 user=app password='it\'s a s3cret' dbname=app",
            "it's a s3cret",
            "host=127.0.0.1 user=app password=*** dbname=app",
        ),
        (
            r"host=127.0.0.1 options='-c\ app.password=kv-s3cret'",
            "kv-s3cret",
            "host=127.0.0.1 options=***",
        ),
        # An unencoded '@': asyncpg takes "p" as the password, "ss@host" as the host.
        (f"postgresql://app:p@ss@{HOST}/app", "p@ss", f"postgresql://app:***@{HOST}/app"),
        # An unencoded '/' ends asyncpg's netloc: nothing after the scheme is shown.
        (f"postgresql://app:pa/ss@{HOST}/app", "pa/ss", "postgresql://***"),
        (f"postgresql://app:p@ss/w@{HOST}/app", "p@ss/w", "postgresql://***"),
    ],
)
def test_a_dsn_is_shown_without_its_secrets(dsn: str, secret: str, shown: str) -> None:
    assert secret in dsn_secrets(dsn)
    assert redact_dsn(dsn) == shown


def test_a_dsn_without_secrets_is_shown_whole() -> None:
    dsn = f"postgresql://app@{HOST}/app?sslmode=require&application_name=x"
    assert dsn_secrets(dsn) == []
    assert redact_dsn(dsn) == dsn
    assert redact_dsn("host=db user=app dbname=app") == "host=db user=app dbname=app"


def test_a_malformed_key_value_dsn_is_hidden_whole() -> None:
    assert redact_dsn("host=db password='unterminated") == REDACTED


def test_the_argv_warning_decides_from_the_parsed_url(capsys: pytest.CaptureFixture[str]) -> None:
    for url in (f"postgresql://app:s3cr'etPW@{HOST}/app", f"postgresql://{HOST}/a?password=x"):
        assert cli.main(["migrate", f"--database-url={url}"]) == 1
        err = capsys.readouterr().err
        assert "password in --database-url is visible" in err
        assert "s3cr'etPW" not in err
    assert cli.main(["migrate", f"--database-url=postgresql://app@{HOST}/app"]) == 1
    assert "visible" not in capsys.readouterr().err


# -- the property: asyncpg's password is the one hidden, everywhere ----------------------

PLACEHOLDER = "Zq9Zq9Zq9"


def asyncpg_secrets(dsn: str) -> list[str]:
    """The password, sslpassword and server settings asyncpg takes from ``dsn``."""
    _, params = connect_utils._parse_connect_dsn_and_args(
        dsn=dsn, host=None, port=None, user=None, password=None, passfile=None,
        database=None, ssl=None, service=None, servicefile=None, direct_tls=None,
        server_settings=None, target_session_attrs=None, krbsrvname=None, gsslib=None,
    )  # fmt: skip
    found = [params.password] if params.password else []
    ssl = getattr(params, "sslpassword", None)  # kept on the SSL context when one is made
    return found + ([ssl] if ssl else [])


def url_forms(password: str) -> list[str]:
    """DSNs carrying ``password`` in every place asyncpg takes one from."""
    return [
        f"postgresql://app:{quote(password, safe='')}@{HOST}/app",
        f"postgresql://{HOST}/app?user=app&password={quote_plus(password)}",
        f"postgres://app:{quote(password, safe='')}@{HOST}/app?sslmode=disable",
    ]


def logged(message: str, *args: object, **extra: object) -> str:
    """One record as the operator's log handler writes it, through the redaction filter."""
    record = logging.LogRecord("test", logging.WARNING, __file__, 1, message, args, None)
    record.__dict__.update(extra)
    logs.RedactingFilter().filter(record)
    return logs.TextFormatter().format(record)


def outputs(dsn: str) -> str:
    """Everything the project prints or logs about ``dsn``."""
    shown = [redact_dsn(dsn)]
    environment = {"KOPF_RECONCILE_DATABASE_URL": dsn, "KOPF_RECONCILE_LEADER": "postgres"}
    try:
        loaded = Settings.load(environment)
    except ConfigError as exc:  # a URL that does not parse: the message is an output too
        shown.append(str(exc))
    else:
        shown += [loaded.describe(), repr(loaded), repr(loaded.build_fenced_repository())]
        shown.append(repr(loaded.build_elector()))
    try:
        Database(dsn.replace("postgres", "mysql", 1), table="t", schema=())
    except ConfigError as exc:
        shown.append(str(exc))
    try:
        Settings.load({"KOPF_RECONCILE_DATABASE_URL": dsn.replace("postgres", "pg", 1)})
    except ConfigError as exc:
        shown.append(str(exc))
    shown += [logged("connecting to %s", dsn), logged("settings %r", {"url": dsn})]
    try:
        raise RuntimeError(f"cannot connect to {dsn!r}")
    except RuntimeError:
        shown.append(logged("failed", exc_info=sys.exc_info()))
    with contextlib.redirect_stderr(io.StringIO()) as err, contextlib.redirect_stdout(err):
        cli.main(["migrate", f"--database-url={dsn}"])
        cli.main(["dead-letters", f"--database-url={dsn}"])
    shown.append(err.getvalue())
    return "\n".join(shown)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.text(st.characters(blacklist_categories=["Cs", "Cc"]), min_size=6, max_size=24).filter(
        lambda p: p.strip() == p
    )
)
def test_the_password_asyncpg_parses_is_the_one_hidden_everywhere(password: str) -> None:
    for form in url_forms(password):
        neutral = outputs(
            form.replace(quote(password, safe=""), PLACEHOLDER).replace(
                quote_plus(password), PLACEHOLDER
            )
        )
        # A password that occurs in what is printed anyway (a host, a word) is no leak.
        assume(password not in neutral)
        assert password in asyncpg_secrets(form)
        assert password in dsn_secrets(form)
        assert password not in outputs(form), form


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.text(st.characters(blacklist_categories=["Cs", "Cc"]), min_size=6, max_size=24).filter(
        lambda p: p.strip() == p
    )
)
def test_a_password_typed_unencoded_is_hidden_too(password: str) -> None:
    typed = f"postgresql://app:{password}@{HOST}/app"
    assume(password not in outputs(f"postgresql://app:{PLACEHOLDER}@{HOST}/app"))
    try:
        taken = asyncpg_secrets(typed)
    except Exception:  # asyncpg refuses the URL (e.g. a '/' ended the host early)
        taken = []
    assert set(taken) <= set(dsn_secrets(typed))
    shown = outputs(typed)
    assert password not in shown, typed
    for secret in taken:
        assert len(secret) < MIN_REMEMBERED_LENGTH or secret not in shown, (typed, secret)


def test_the_issues_example_is_hidden_by_every_command(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KOPF_RECONCILE_DATABASE_URL", f"postgresql://app:s3cr'etPW@{HOST}/app")
    for command in (["dead-letters"], ["redrive", "default/x"], ["migrate"], ["leases"]):
        cli.main(command)
        shown = capsys.readouterr()
        assert "s3cr'etPW" not in shown.out + shown.err, command
        assert "etPW" not in shown.out + shown.err, command


def test_free_text_hides_a_remembered_password_however_it_is_rendered() -> None:
    password = "q'u\"o te%/@"
    dsn = f"postgresql://app:{quote(password, safe='')}@{HOST}/app"
    Settings.load({"KOPF_RECONCILE_DATABASE_URL": dsn})
    for rendering in (password, quote(password, safe=""), repr(password), quote_plus(password)):
        assert password not in redact(f"asyncpg said: {rendering}!")
        assert quote(password, safe="") not in redact(f"asyncpg said: {rendering}!")


def test_key_value_text_holding_a_url_in_a_value_is_not_taken_for_a_url(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    dsn = f"host={HOST} password=Hunter2Secret application_name=http://x"
    assert "Hunter2Secret" not in redact_dsn(dsn)
    assert "Hunter2Secret" in redaction.dsn_secrets(dsn)
    monkeypatch.setenv("KOPF_RECONCILE_DATABASE_URL", dsn)
    for command in (["migrate"], ["dead-letters"]):
        cli.main(command)
        shown = capsys.readouterr()
        assert "Hunter2Secret" not in shown.out + shown.err, command


def test_an_unencoded_at_sign_in_the_password_is_refused_and_no_piece_of_it_shown(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # asyncpg ends this password at the first '@', and its error quotes what follows.
    dsn = "postgresql://app:Sup3r@Secr3t:Tail9zz@127.0.0.1:5432/app"
    with pytest.raises(ConfigError, match="percent-encode it as %40") as refused:
        Settings.load({"KOPF_RECONCILE_DATABASE_URL": dsn})
    for piece in ("Sup3r", "Secr3t", "Tail9zz"):
        assert piece not in str(refused.value)
    monkeypatch.setenv("KOPF_RECONCILE_DATABASE_URL", dsn)
    for command in (["migrate"], ["dead-letters"], ["status"]):
        cli.main(command)
        shown = capsys.readouterr()
        for piece in ("Sup3r", "Secr3t", "Tail9zz"):
            assert piece not in shown.out + shown.err, command
    redaction.remember_dsn(dsn)
    assert "Tail9zz" not in redact("invalid literal for int() with base 10: 'Tail9zz@127.0.0.1'")


def test_a_password_is_hidden_as_typed_in_a_non_canonical_encoding() -> None:
    for typed in ("s%65cretpw", "pa%2fss%2fword"):
        redaction.remember_dsn(f"postgresql://app:{typed}@{HOST}/app")
        redaction.remember_dsn(f"postgresql://app@{HOST}/app?password={typed}")
        assert typed not in redact(f"the URL said {typed} here")
