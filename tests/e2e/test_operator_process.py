"""``kopf-reconcile run`` as a process: secrets never reach its logs, bad configuration
stops it at startup with a message naming the variable (plain ``kopf run`` too)."""

from __future__ import annotations

import json

import aiohttp
import pytest
from operator_e2e import OPERATORS, Operators

pytestmark = [pytest.mark.slow, pytest.mark.parametrize("kube", ["embedded"], indirect=True)]

PASSWORD = "Pg-s3cret-9f2a"
TOKEN = "eyJhbGciOiJSUzI1NiJ9.c2VjcmV0LXRva2Vu.c2lnbmF0dXJl"


async def test_passwords_and_tokens_never_reach_the_logs(
    operators: Operators, http: aiohttp.ClientSession, embedded_postgres_dsn: str
) -> None:
    # Trust authentication ignores the password, so the DSN works and is used for real.
    dsn = embedded_postgres_dsn.replace(
        "postgresql://postgres@", f"postgresql://postgres:{PASSWORD}@"
    )
    assert PASSWORD in dsn
    operator = await operators.start(
        "--debug",
        "--log-format=json",
        handlers=OPERATORS / "leaky.py",
        env={
            "KOPF_RECONCILE_DATABASE_URL": dsn,
            "KOPF_RECONCILE_LEADER": "postgres",
            "TEST_BEARER_TOKEN": TOKEN,
        },
    )
    url = f"/api/v1/namespaces/{operators.namespace}/configmaps"
    body = {"metadata": {"name": "settings"}, "data": {"k": "v"}}
    async with http.post(url, json=body) as response:
        assert response.status == 201
    await operator.printed("leaked everything for")
    assert await operator.stop() == 0

    records = [json.loads(line) for line in operator.output if line.strip()]
    messages = "\n".join(json.dumps(r) for r in records)
    assert PASSWORD not in operator.text
    assert TOKEN not in operator.text
    # The leaks were logged, redacted: as arguments, in a dict, and in an exception's text.
    assert "postgresql://postgres:***@" in messages
    assert "'Authorization': '***'" in messages
    failed = [r for r in records if "retrying in" in r["message"]]
    assert failed and "Authorization: ***" in failed[0]["exception"]
    assert any(r["message"] == "retrying with Authorization: ***" for r in records)


@pytest.mark.parametrize("command", ["kopf-reconcile", "kopf"])
@pytest.mark.parametrize(
    ("env", "expected"),
    [
        pytest.param(
            {"KOPF_RECONCILE_LEASE_TTL": "soon"},
            "KOPF_RECONCILE_LEASE_TTL must be a number of seconds, got 'soon'",
            id="bad-ttl",
        ),
        pytest.param(
            {"KOPF_RECONCILE_LEADER": "postgres"},
            "KOPF_RECONCILE_LEADER=postgres needs a database: set KOPF_RECONCILE_DATABASE_URL",
            id="missing-database",
        ),
    ],
)
async def test_bad_configuration_stops_the_operator_naming_the_variable(
    operators: Operators, command: str, env: dict[str, str], expected: str
) -> None:
    status, output = await operators.run_to_exit(command=command, env=env)
    assert status != 0
    assert expected in output, output
