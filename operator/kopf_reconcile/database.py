"""Where a PostgreSQL adapter keeps its table: a pool and the schema it needs.

The fenced repository and the lease elector both take either a DSN or an
asyncpg pool the application already has. A :class:`Database` made from a DSN
creates its pool lazily on first use and owns it (:meth:`Database.close`
closes it); a borrowed pool belongs to whoever created it and is never closed
here. Either way the adapter's tables are created on first use, once per
instance, and on demand by :meth:`Database.migrate`.

Schema creation must survive several processes starting at once:
``CREATE TABLE IF NOT EXISTS`` alone is not race-free (two sessions can both
decide the table is missing and one then fails on a catalog unique index), so
the DDL runs in a transaction holding an advisory lock derived from the table
name.

:func:`check_database` is what ``kopf-reconcile run`` asks before it starts: a URL
the server refuses (credentials, role, database name) is a configuration error,
while a server that does not answer yet may answer later and is only reported.

DSNs carry passwords; every message and ``repr`` here shows them redacted, and a DSN
given here has its secrets hidden from every later log line (:mod:`kopf_reconcile.redaction`).
"""

from __future__ import annotations

import asyncio
import hashlib
import re
from collections.abc import Mapping, Sequence

import asyncpg

from kopf_reconcile.api import ConfigError
from kopf_reconcile.redaction import redact, redact_dsn, remember_dsn
from kopf_reconcile.remote_errors import describe_error

__all__ = ["Database", "check_database", "is_postgres_url", "qualified_table", "redact_dsn"]

# A pool made from a DSN: one warm connection, growing on demand.
POOL_MIN_SIZE = 1
POOL_MAX_SIZE = 10
# Closing an owned pool waits this long for borrowed connections, then terminates them.
CLOSE_GRACE_SECONDS = 5.0

_DSN_SCHEMES = ("postgresql", "postgres")
# The server refused the URL itself (credentials, role, database name): the same URL
# never succeeds, however long it is retried.
_REFUSED = (asyncpg.InvalidAuthorizationSpecificationError, asyncpg.InvalidCatalogNameError)
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")


def is_postgres_url(text: str) -> bool:
    """Whether ``text`` is a ``postgresql://`` (or ``postgres://``) URL, by its scheme alone.

    Parsing more here would raise on a malformed URL with a message that is not ours.
    """
    scheme, sep, _ = text.partition("://")
    return bool(sep) and scheme.lower() in _DSN_SCHEMES


def qualified_table(option: str, name: object) -> str:
    """Validate a table name (``table`` or ``schema.table``) and quote it for SQL."""
    parts = name.split(".") if isinstance(name, str) else []
    if not parts or len(parts) > 2 or not all(_IDENTIFIER.fullmatch(part) for part in parts):
        raise ConfigError(
            f"{option} must be an SQL identifier of letters, digits and underscores "
            f"(at most 63, not starting with a digit), optionally schema-qualified "
            f"as schema.table; got {name!r}"
        )
    return ".".join(f'"{part}"' for part in parts)


async def check_database(dsn: str, source: str, timeout: float) -> str | None:
    """Connect once: ``None`` when the server accepts ``dsn``, else why it cannot be reached.

    A refusal of the URL itself (a wrong password, an unknown role or database) is
    a :class:`ConfigError` naming ``source``: only a changed configuration fixes it.
    A server that does not answer (refused connection, timeout, starting up) may
    answer later, so that is returned, on one line, for the caller to report.
    """
    remember_dsn(dsn)
    try:
        connection = await asyncpg.connect(dsn, timeout=timeout)
    except _REFUSED as exc:
        raise ConfigError(
            f"{source} ({redact_dsn(dsn)}) is refused by the database: "
            f"{redact(describe_error(exc))}"
        ) from None
    except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        return redact(describe_error(exc))
    except ValueError:
        raise unreadable_url(source, dsn) from None
    await connection.close()
    return None


def unreadable_url(source: str, dsn: str) -> ConfigError:
    """A URL asyncpg cannot read: its own message may quote pieces of the password."""
    return ConfigError(
        f"{source} ({redact_dsn(dsn)}) cannot be read as a PostgreSQL URL: percent-encode "
        "'@', ':', '/', '?', '#' and ',' in the user name and password"
    )


class Database:
    """A pool (owned when made from a DSN, else borrowed) plus the schema an adapter needs."""

    def __init__(
        self,
        dsn_or_pool: object,
        *,
        table: str,
        schema: Sequence[str],
        option: str = "dsn_or_pool",
        server_settings: Mapping[str, str] | None = None,
    ) -> None:
        """``table`` is the quoted name the advisory lock derives from; ``schema`` the DDL.

        ``server_settings`` apply to every connection of a pool made from a DSN
        (a borrowed pool keeps its own).
        """
        self._dsn: str | None = None
        self._pool: asyncpg.Pool | None = None
        if isinstance(dsn_or_pool, asyncpg.Pool):
            self._pool = dsn_or_pool
        elif isinstance(dsn_or_pool, str) and is_postgres_url(dsn_or_pool):
            remember_dsn(dsn_or_pool)
            self._dsn = dsn_or_pool
        else:
            shown = redact_dsn(dsn_or_pool) if isinstance(dsn_or_pool, str) else dsn_or_pool
            raise ConfigError(
                f"{option} must be a PostgreSQL DSN (postgresql://...) or an asyncpg pool, "
                f"got {type(dsn_or_pool).__name__} {shown!r}"
            )
        self._schema = tuple(schema)
        self._server_settings = dict(server_settings or {})
        self._schema_lock_key = _advisory_key(f"kopf_reconcile schema {table}")
        self._schema_ready = False
        self._closed = False
        # Serialises pool creation, schema creation and close within this process.
        self._lock = asyncio.Lock()

    @property
    def owns_pool(self) -> bool:
        """Whether :meth:`close` closes the pool (it was created from a DSN)."""
        return self._dsn is not None

    def describe(self) -> str:
        """Where the data lives, safe to log: the redacted DSN or "a borrowed pool"."""
        return redact_dsn(self._dsn) if self._dsn is not None else "a borrowed asyncpg pool"

    async def pool(self) -> asyncpg.Pool:
        """The pool, with this adapter's schema in place."""
        if self._pool is not None and self._schema_ready and not self._closed:
            return self._pool
        async with self._lock:
            pool = await self._pool_locked()
            if not self._schema_ready:
                await self._create_schema(pool)
                self._schema_ready = True
            return pool

    async def existing_pool(self) -> asyncpg.Pool:
        """The pool, creating nothing: for readers that must not create the schema."""
        async with self._lock:
            return await self._pool_locked()

    async def migrate(self) -> None:
        """Create the schema now (idempotent; safe while other processes do the same)."""
        async with self._lock:
            await self._create_schema(await self._pool_locked())
            self._schema_ready = True

    async def close(self) -> None:
        """Close the pool if this object created it; a borrowed pool is left open. Idempotent."""
        async with self._lock:
            self._closed = True
            if self._dsn is None or self._pool is None:
                return
            pool, self._pool = self._pool, None
            try:
                await asyncio.wait_for(pool.close(), CLOSE_GRACE_SECONDS)
            except TimeoutError:
                pool.terminate()

    async def _pool_locked(self) -> asyncpg.Pool:
        if self._closed:
            raise RuntimeError(f"the PostgreSQL adapter for {self.describe()} is closed")
        if self._pool is None:
            try:
                self._pool = await asyncpg.create_pool(
                    self._dsn,
                    min_size=POOL_MIN_SIZE,
                    max_size=POOL_MAX_SIZE,
                    server_settings=self._server_settings or None,
                )
            except ValueError:
                raise unreadable_url("the database URL", str(self._dsn)) from None
        return self._pool

    async def _create_schema(self, pool: asyncpg.Pool) -> None:
        async with pool.acquire() as connection, connection.transaction():
            await connection.execute("SELECT pg_advisory_xact_lock($1)", self._schema_lock_key)
            for statement in self._schema:
                await connection.execute(statement)


def _advisory_key(text: str) -> int:
    """A stable signed 64-bit advisory-lock key for ``text``."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big", signed=True)
