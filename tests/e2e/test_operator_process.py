"""``kopf-reconcile run`` as a process: secrets never reach its logs, bad configuration
stops it at startup with a message naming the variable (plain ``kopf run`` too)."""

from __future__ import annotations

import asyncio
import json
import signal

import aiohttp
import pytest
from operator_e2e import BIN, EXAMPLE, OPERATORS, Operators

from support import eventually

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


@pytest.mark.parametrize(
    ("env", "variable"),
    [
        pytest.param(
            {"KOPF_RECONCILE_LEADER": "kubernetes", "KOPF_RECONCILE_LEASE_TTL": "3000000000"},
            "KOPF_RECONCILE_LEASE_TTL",
            id="ttl-beyond-int32",
        ),
        pytest.param(
            {"KOPF_RECONCILE_RENEW_INTERVAL": "0.000001"},
            "KOPF_RECONCILE_RENEW_INTERVAL",
            id="tight-renewal-loop",
        ),
        pytest.param({"POD_NAMESPACE": "Not A Namespace"}, "POD_NAMESPACE", id="bad-namespace"),
        pytest.param(
            {"KOPF_RECONCILE_LEADER": "kubernetes", "POD_NAMESPACE": "no-such-namespace"},
            "POD_NAMESPACE",
            id="missing-namespace",
        ),
        pytest.param(
            {"KOPF_RECONCILE_METRICS_PORT": "\u0668\u0660\u0668\u0660"},  # Arabic-Indic 8080
            "KOPF_RECONCILE_METRICS_PORT",
            id="non-ascii-port",
        ),
        pytest.param(
            {"KOPF_RECONCILE_LEASE_TTL": "\u0661\u0665"},  # Arabic-Indic 15
            "KOPF_RECONCILE_LEASE_TTL",
            id="non-ascii-seconds",
        ),
    ],
)
async def test_values_that_cannot_work_stop_the_operator_before_kopf_starts(
    operators: Operators, env: dict[str, str], variable: str
) -> None:
    # Not operators.start(): its --metrics-port would hide the variable's value.
    process = await asyncio.create_subprocess_exec(
        str(BIN / "kopf-reconcile"),
        "run",
        str(EXAMPLE),
        f"--namespace={operators.namespace}",
        env=operators.environment({"KOPF_RECONCILE_METRICS_PORT": "0", **env}),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        stdout, _ = await asyncio.wait_for(process.communicate(), 30)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    output = stdout.decode(errors="replace")
    assert process.returncode == 2, output
    assert f"configuration error: {variable} " in output, output
    assert "Traceback" not in output


async def test_readiness_turns_false_as_soon_as_shutdown_begins(
    operators: Operators, http: aiohttp.ClientSession
) -> None:
    operator = await operators.start(
        handlers=OPERATORS / "draining.py", env={"KOPF_RECONCILE_STOP_TIMEOUT": "10"}
    )
    url = f"/api/v1/namespaces/{operators.namespace}/configmaps"
    async with http.post(url, json={"metadata": {"name": "held"}}) as response:
        assert response.status == 201
    await operator.printed("holding", "/held until cancelled")

    async def answers_ready() -> bool:
        return (await operator.get("/readyz"))[0] == 200

    await eventually(answers_ready, timeout=10, interval=0.05, message="/readyz 200")

    async def answers_not_ready() -> bool:
        try:
            status, _ = await operator.get("/readyz")
        except aiohttp.ClientError:
            return False  # not serving (any more): that is not the answer awaited
        return status == 503

    operator.process.send_signal(signal.SIGTERM)
    # The reconcile holds the shutdown for up to the stop timeout; meanwhile the
    # process serves, and must already say it is not ready.
    await eventually(answers_not_ready, timeout=9, interval=0.05, message="/readyz 503")
    assert operator.process.returncode is None
    assert await operator.stop(timeout=40) == 0
