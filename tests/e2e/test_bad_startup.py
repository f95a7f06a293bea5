"""Bad input and misuse at startup: ``kopf-reconcile run`` against a database or an API
server it cannot use (rows of the "Bad input and misuse" table in docs/reliability.md).

What it does, and why:

* the database refuses the credentials (wrong password, unknown role or database):
  retrying the same URL cannot succeed, so the process stops before kopf starts,
  with a configuration error naming ``KOPF_RECONCILE_DATABASE_URL`` and what the
  server said (exit 2; an orchestrator restarts it, and picks up a fixed Secret);
* the database does not answer (a closed port): the operator starts, says so on one
  line naming the variable, and keeps retrying: the database may come up after the
  operator (as it may go away and come back later, see ``test_pg_outage.py``); no
  reconciler leads meanwhile and each failed attempt is logged and counted;
* the Kubernetes API does not answer: kopf itself retries its watches; the lease
  namespace check says so on one line and leaves it to the retries.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from pathlib import Path

import asyncpg
import pytest
import yaml
from operator_e2e import BIN, EXAMPLE, Operators

from kopf_reconcile.testing.postgres import EmbeddedPostgres

pytestmark = [pytest.mark.slow, pytest.mark.parametrize("kube", ["embedded"], indirect=True)]

WRONG = "not-the-password"


def closed_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (bound, then closed)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def run_until_exit(
    operators: Operators, env: dict[str, str], timeout: float = 30
) -> tuple[int | None, str]:
    """``kopf-reconcile run`` the example; its status (None: still running) and output."""
    operator = await operators.start(env=env)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(operator.process.wait(), timeout)
    status = operator.process.returncode
    await operator.stop()
    return status, operator.text


async def password_protected(server: EmbeddedPostgres) -> str:
    """A role that must give its password; the URL with the wrong one."""
    connection = await asyncpg.connect(server.dsn)
    try:
        await connection.execute("CREATE ROLE app LOGIN PASSWORD 'right-password'")
    finally:
        await connection.close()
    hba = server.data_dir / "pg_hba.conf"
    # First match wins: this role must authenticate; everyone else keeps trust.
    hba.write_text("local all app scram-sha-256\n" + hba.read_text())
    connection = await asyncpg.connect(server.dsn)
    try:
        await connection.execute("SELECT pg_reload_conf()")
    finally:
        await connection.close()
    return server.dsn.replace("postgresql://postgres@", f"postgresql://app:{WRONG}@")


async def test_a_database_that_refuses_the_password_stops_the_operator_at_startup(
    operators: Operators, embedded_postgres: EmbeddedPostgres
) -> None:
    dsn = await password_protected(embedded_postgres)
    with pytest.raises(asyncpg.InvalidPasswordError):
        await asyncpg.connect(dsn)
    status, output = await run_until_exit(operators, {"KOPF_RECONCILE_DATABASE_URL": dsn})
    assert status == 2, output
    assert WRONG not in output
    assert "configuration error: KOPF_RECONCILE_DATABASE_URL (postgresql://app:***@" in output, (
        output
    )
    assert 'password authentication failed for user "app"' in output, output
    assert "Traceback" not in output


async def test_a_database_that_does_not_answer_is_said_once_and_retried(
    operators: Operators,
) -> None:
    dsn = f"postgresql://app:{WRONG}@127.0.0.1:{closed_port()}/app"
    operator = await operators.start(
        env={"KOPF_RECONCILE_DATABASE_URL": dsn, "KOPF_RECONCILE_RENEW_INTERVAL": "0.2"}
    )
    line = await operator.printed("cannot reach the database", timeout=30)
    assert "KOPF_RECONCILE_DATABASE_URL (postgresql://app:***@127.0.0.1:" in line, line
    assert "retrying" in line
    # Still running, a follower, telling why on every attempt.
    await operator.printed("acquiring lease", "failed", timeout=30)
    assert operator.process.returncode is None
    assert not await operator.is_leader()
    assert WRONG not in operator.text
    assert await operator.stop() == 0


async def test_an_api_server_that_does_not_answer_is_said_and_retried(
    operators: Operators, tmp_path: Path
) -> None:
    config = yaml.safe_load(await asyncio.to_thread(Path(operators.kubeconfig).read_text))
    for cluster in config["clusters"]:
        cluster["cluster"]["server"] = f"http://127.0.0.1:{closed_port()}"
    unreachable = tmp_path / "kubeconfig"
    await asyncio.to_thread(unreachable.write_text, yaml.safe_dump(config))
    operators.kubeconfig = str(unreachable)
    operator = await operators.start(
        env={"KOPF_RECONCILE_LEADER": "kubernetes", "KOPF_RECONCILE_RENEW_INTERVAL": "0.2"}
    )
    line = await operator.printed("cannot check that the namespace of the Leases exists")
    assert "Cannot connect to host 127.0.0.1:" in line, line
    await operator.printed("acquiring lease", "failed: ClientConnectorError", timeout=30)
    assert operator.process.returncode is None
    status, _ = await operator.get("/readyz")
    assert status != 200
    assert not await operator.is_leader()
    assert await operator.stop() == 0


@pytest.mark.parametrize(
    ("host", "expected"),
    [
        pytest.param("127.0.0.1", "address already in use", id="port-in-use"),
        pytest.param("203.0.113.7", "cannot assign requested address", id="address-not-here"),
    ],
)
async def test_a_metrics_address_that_cannot_be_served_stops_the_operator_naming_it(
    operators: Operators, host: str, expected: str
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        process = await asyncio.create_subprocess_exec(
            str(BIN / "kopf-reconcile"),
            "run",
            str(EXAMPLE),
            f"--namespace={operators.namespace}",
            env=operators.environment(
                {"KOPF_RECONCILE_METRICS_HOST": host, "KOPF_RECONCILE_METRICS_PORT": str(port)}
            ),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        stdout, _ = await asyncio.wait_for(process.communicate(), 30)
    output = stdout.decode(errors="replace")
    assert process.returncode == 1, output
    line = next(line for line in output.splitlines() if "cannot serve" in line)
    assert f"on {host}:{port} (KOPF_RECONCILE_METRICS_HOST, KOPF_RECONCILE_METRICS_PORT)" in line
    assert expected in line.lower(), line
    assert "Traceback" not in output
