"""Secrets out of text: database passwords, bearer tokens, Authorization values.

One set of rules, used for every log record (``logs.RedactingFilter``), every
DSN shown in a message or a ``repr`` (:mod:`kopf_reconcile.database`), and nowhere duplicated.
The rules match how secrets look when rendered by Python: URLs, libpq
keyword DSNs and query strings, environment assignments, ``dict``/JSON and
header-tuple renderings.
"""

from __future__ import annotations

import re

REDACTED = "***"

_RULES: tuple[tuple[re.Pattern[str], str], ...] = (
    # A password in a URL's userinfo: scheme://user:password@host. The password runs to
    # the last '@' before whitespace or a quote, so '@', '/', '#' or '?' in it never
    # reveal half of it.
    (re.compile(r"""(\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s:/@'"]*:)[^\s'"]*(@)"""), rf"\1{REDACTED}\2"),
    # Keyword assignments: password=x, sslpassword=x, PGPASSWORD=x, ?password=x&...
    (re.compile(r"(\w*password\s*=\s*)('[^']*'|[^\s&;,]+)", re.IGNORECASE), rf"\1{REDACTED}"),
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
    """``text`` with passwords, bearer tokens and Authorization values replaced by ``***``."""
    for pattern, replacement in _RULES:
        text = pattern.sub(replacement, text)
    return text
