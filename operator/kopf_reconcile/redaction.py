"""Secrets out of text: database passwords, bearer tokens, Authorization values.

Database passwords are found by parsing, never guessed from how text looks:
:func:`dsn_secrets` reads a DSN the way asyncpg reads a URL (``urlparse``, the
user-info split at the netloc's first ``@`` and first ``:``, percent-decoding,
query parameters as ``parse_qs`` decodes them) and the way libpq reads a
``key=value`` connection string (single quotes, backslash escapes). Every
value that asyncpg or libpq would send as a secret is one: the user-info
password, ``password`` and ``sslpassword`` parameters, any server setting
named like a password, and such settings inside ``options`` (``-c x=y``,
``--x=y``).

Three ways out, one module:

* :func:`redact_dsn` renders a DSN with those values replaced by ``***``
  (for messages and reprs that show where the data lives);
* :func:`remember_dsn` records a configured DSN's secrets, and :func:`redact`
  (every log record through ``logs.RedactingFilter``, every error text) hides
  them wherever they appear and however they were rendered (as typed,
  percent-encoded, ``repr``- or JSON-escaped);
* :func:`redact` then applies the rules below for secrets nobody configured
  (a DSN or a token inside a library's message): those are patterns, a second
  line of defence only.
"""

from __future__ import annotations

import json
import re
import threading
from urllib.parse import quote, quote_plus, unquote, unquote_plus, urlparse

__all__ = ["REDACTED", "dsn_secrets", "redact", "redact_dsn", "remember_dsn"]

REDACTED = "***"

# A remembered secret this short is hidden in DSNs but not in free text: it would
# occur in unrelated words of every line.
MIN_REMEMBERED_LENGTH = 4
_remembered: set[str] = set()
_remembered_lock = threading.Lock()

_RULES: tuple[tuple[re.Pattern[str], str], ...] = (
    # A password in a URL's userinfo: scheme://user:password@host. Where such a URL ends
    # in free text cannot be known (a password may hold spaces, quotes, '@', '/'): the
    # password runs to the line's last '@', hiding too much rather than half of it.
    (re.compile(r"""(\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s:/@'"]*:)[^\r\n]*(@)"""), rf"\1{REDACTED}\2"),
    # Keyword assignments: password=x, sslpassword=x, PGPASSWORD=x, ?password=x&...
    (
        re.compile(r"(\w*password\s*=\s*)('(?:[^'\\]|\\.)*'?|[^\s&;,]+)", re.IGNORECASE),
        rf"\1{REDACTED}",
    ),
    # dict and JSON renderings: 'password': 'x', "db_password": "x", "password": 123.
    (
        re.compile(
            r"""(['"]\w*password['"]\s*:\s*)(['"]?)(?:(?<=')[^']*|(?<=")[^"]*|[^\s,}]+)""",
            re.IGNORECASE,
        ),
        rf"\1\2{REDACTED}",
    ),
    # Authorization values in any rendering: "Authorization: Basic x", {'Authorization':
    # 'Bearer x'}, ('Authorization', 'Basic x'), authorization=x. To the quote or line end.
    (
        re.compile(r"""(\bauthorization['"]?\s*[:=,]\s*['"]?)[^'"\r\n]+""", re.IGNORECASE),
        rf"\1{REDACTED}",
    ),
    # Bearer tokens wherever they appear.
    (re.compile(r"(\bbearer\s+)[A-Za-z0-9._~+/=-]+", re.IGNORECASE), rf"\1{REDACTED}"),
)


def redact(text: str) -> str:
    """``text`` with remembered DSN secrets, passwords, bearer tokens and Authorization
    values replaced by ``***``."""
    with _remembered_lock:
        secrets = sorted(_remembered, key=len, reverse=True)
    for secret in secrets:
        for rendering in _renderings(secret):
            text = text.replace(rendering, REDACTED)
    for pattern, replacement in _RULES:
        text = pattern.sub(replacement, text)
    return text


def remember_dsn(dsn: str) -> None:
    """Hide ``dsn``'s secrets from every later :func:`redact` of this process."""
    found = [secret for secret in dsn_secrets(dsn) if len(secret) >= MIN_REMEMBERED_LENGTH]
    with _remembered_lock:
        _remembered.update(found)


def _is_url(dsn: str) -> bool:
    """Whether ``dsn`` is a URL (``scheme://...``), not ``key=value`` text that merely holds
    a ``://`` in some value (``application_name=http://x``): as libpq and asyncpg decide."""
    return _URL_START.match(dsn) is not None


_URL_START = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


def dsn_secrets(dsn: str) -> list[str]:
    """Every secret asyncpg or libpq would take from ``dsn``, decoded as they decode it."""
    if _is_url(dsn):
        try:
            return _url_secrets(dsn)
        except ValueError:  # urlparse refuses it (an unclosed '['): all of it is suspect
            return [dsn.partition("://")[2]]
    try:
        pairs = _conninfo_pairs(dsn)
    except ValueError:
        return [dsn] if "=" in dsn else []
    return [secret for name, value in pairs for secret in _setting_secrets(name, value)]


def redact_dsn(dsn: str) -> str:
    """``dsn`` (a URL or a ``key=value`` string) with every secret replaced by ``***``.

    Text that is not a DSN comes back through :func:`redact`; a DSN that cannot be
    parsed keeps only what surely is no secret (its scheme, or nothing).
    """
    if _is_url(dsn):
        return _redact_url(dsn)
    if "=" not in dsn:
        return redact(dsn)
    try:
        pairs = _conninfo_pairs(dsn)
    except ValueError:
        return REDACTED
    return " ".join(
        f"{name}={REDACTED if _setting_secrets(name, value) else _conninfo_quote(value)}"
        for name, value in pairs
    )


# -- URLs, as asyncpg reads them ----------------------------------------------------


def _url_secrets(dsn: str) -> list[str]:
    parsed = urlparse(dsn)
    auth, at, _ = parsed.netloc.partition("@")
    secrets = []
    if at:
        _, _, password = auth.partition(":")
        if password:
            secrets += [unquote(password), password]  # decoded, and as typed
        # An unencoded '@' in the password: asyncpg takes the part before it, the rest of
        # the password meant runs to the netloc's last '@'.
        meant = parsed.netloc.rpartition("@")[0].partition(":")[2]
        if meant != password:
            secrets += [meant, unquote(meant)]
            # asyncpg reads the rest as hosts and ports and may echo a piece of it in an
            # error ("invalid literal for int(): 'tail@host:5432'"): hide each piece too.
            secrets += [piece for piece in re.split(r"[@:,]", meant) if piece]
    if parsed.query:
        for piece in parsed.query.split("&"):
            name, _, value = piece.partition("=")
            found = _setting_secrets(unquote_plus(name), unquote_plus(value))
            secrets.extend(found)
            if found and value not in found:
                secrets.append(value)  # as typed too (%65 for e, lowercase escapes)
    if _stray_at(dsn, parsed.netloc):
        # The password meant runs to the last '@': hide it as typed and as decoded.
        userinfo = dsn.partition("://")[2].rpartition("@")[0]
        meant = userinfo.partition(":")[2] or userinfo
        secrets += [meant, unquote(meant)]
    return secrets


def _redact_url(dsn: str) -> str:
    scheme = dsn.partition("://")[0]
    try:
        parsed = urlparse(dsn)
    except ValueError:
        return f"{scheme}://{REDACTED}"
    if _stray_at(dsn, parsed.netloc):
        # An unencoded '/', '?' or '#' in the password ends the netloc early: the password
        # meant runs on into the path, query or fragment, so none of it is shown.
        return f"{scheme}://{REDACTED}"
    auth, at, hosts = parsed.netloc.rpartition("@")  # '@' in a password: all of it hidden
    if at:
        user, _, password = auth.partition(":")
        auth = f"{user}:{REDACTED}" if password else auth
    netloc = f"{auth}@{hosts}" if at else parsed.netloc
    query = "&".join(_redact_query_piece(piece) for piece in parsed.query.split("&"))
    shown = f"{parsed.scheme}://{netloc}{parsed.path}"
    shown += f";{parsed.params}" if parsed.params else ""
    shown += f"?{query}" if parsed.query else ""
    return shown + (f"#{parsed.fragment}" if parsed.fragment else "")


def _stray_at(dsn: str, netloc: str) -> bool:
    """Whether an '@' follows the netloc: a password's '/', '?' or '#' ended it early."""
    rest = dsn.partition("://")[2]
    return "@" in rest[rest.find(netloc) + len(netloc) :] if netloc in rest else "@" in rest


def _redact_query_piece(piece: str) -> str:
    name, _, value = piece.partition("=")
    if _setting_secrets(unquote_plus(name), unquote_plus(value)):
        return f"{name}={REDACTED}"
    return piece


# -- key=value connection strings, as libpq reads them ------------------------------


def _conninfo_pairs(text: str) -> list[tuple[str, str]]:
    """libpq's conninfo grammar: ``name = value`` pairs, values optionally single-quoted."""
    pairs: list[tuple[str, str]] = []
    position, end = 0, len(text)
    while True:
        while position < end and text[position].isspace():
            position += 1
        if position == end:
            return pairs
        start = position
        while position < end and text[position] != "=" and not text[position].isspace():
            position += 1
        name = text[start:position]
        while position < end and text[position].isspace():
            position += 1
        if not name or position == end or text[position] != "=":
            raise ValueError(f"missing '=' after {name!r} in a connection string")
        position += 1
        while position < end and text[position].isspace():
            position += 1
        value, position = _conninfo_value(text, position)
        pairs.append((name, value))


def _conninfo_value(text: str, position: int) -> tuple[str, int]:
    quoted = position < len(text) and text[position] == "'"
    position += quoted
    value = []
    while position < len(text):
        char = text[position]
        if char == "\\" and position + 1 < len(text):
            value.append(text[position + 1])
            position += 2
            continue
        if (char == "'") if quoted else char.isspace():
            return "".join(value), position + quoted
        value.append(char)
        position += 1
    if quoted:
        raise ValueError("unterminated quoted string in a connection string")
    return "".join(value), position


def _conninfo_quote(value: str) -> str:
    if value and not any(char.isspace() or char in "'\\" for char in value):
        return value
    escaped = value.replace("\\", "\\\\").replace("'", "\\'")
    return f"'{escaped}'"


# -- which settings are secrets ---------------------------------------------------------


def _setting_secrets(name: str, value: str) -> list[str]:
    """The secrets in one setting: a password-named one's value, or those in ``options``."""
    if "password" in name.lower():
        return [value] if value else []
    if name.lower() == "options":
        return _options_secrets(value)
    return []


def _options_secrets(options: str) -> list[str]:
    """Password-named settings in libpq's ``options`` (``-c name=value``, ``--name=value``)."""
    words = _option_words(options)
    settings = []
    for index, word in enumerate(words):
        if word == "-c" and index + 1 < len(words):
            settings.append(words[index + 1])
        elif word.startswith(("-c", "--")) and word != "-c":
            settings.append(word[2:])
    secrets = []
    for setting in settings:
        name, equals, value = setting.partition("=")
        if equals and "password" in name.lower() and value:
            secrets.append(value)
    # The whole options value too: a renderer shows it either whole or not at all.
    return [options, *secrets] if secrets else []


def _option_words(options: str) -> list[str]:
    """The server's split of ``options``: at unescaped whitespace, backslash escapes."""
    words: list[str] = []
    word: list[str] = []
    escaped = False
    for char in options:
        if escaped:
            word.append(char)
            escaped = False
        elif char == "\\":
            escaped = True
        elif char.isspace():
            if word:
                words.append("".join(word))
            word = []
        else:
            word.append(char)
    if word:
        words.append("".join(word))
    return words


def _renderings(secret: str) -> list[str]:
    """The forms a secret takes in text: as typed, percent-encoded, repr- and JSON-escaped."""
    forms = {
        secret,
        quote(secret, safe=""),
        quote(secret),
        quote_plus(secret),
        repr(secret)[1:-1],
        json.dumps(secret)[1:-1],
        json.dumps(secret, ensure_ascii=False)[1:-1],
    }
    return sorted(forms, key=len, reverse=True)
