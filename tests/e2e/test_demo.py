"""`kopf-reconcile demo` end to end: its summary, its exit code, and its cleanup."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
DEMO = [sys.executable, "-m", "kopf_reconcile", "demo"]


def summary_value(output: str, row: str) -> str:
    match = re.search(rf"^\s+{re.escape(row)}\s+(\S+)", output, re.MULTILINE)
    assert match, f"no {row!r} row in the summary:\n{output}"
    return match.group(1)


def run_demo(*options: str, timeout: float) -> str:
    """The demo's whole output; it must exit 0."""
    result = subprocess.run(
        [*DEMO, *options], cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    return output


def test_demo_runs_the_story_and_every_invariant_holds() -> None:
    output = run_demo("--objects", "20", "--ttl", "2", "--work-delay", "0.1", timeout=240)
    assert summary_value(output, "objects") == "20"
    assert summary_value(output, "converged") == "20"
    assert summary_value(output, "failovers") == "2"
    assert summary_value(output, "stale writes accepted") == "0"
    assert summary_value(output, "stale API writes accepted") == "0"
    assert summary_value(output, "lost updates") == "0"
    assert "every invariant held" in output
    assert "REJECTED by the database" in output
    assert "$ kopf-reconcile leases" in output
    # The malformed Device: a Warning DeadLettered Event, and a dead letter in PostgreSQL
    # that both failovers kept.
    assert int(summary_value(output, "dead-lettered events")) >= 1
    assert int(summary_value(output, "dead letter attempts")) >= 1
    assert re.search(r"Warning\s+DeadLettered\s+x\d+\s+Device default/device-malformed", output)
    assert "$ kopf-reconcile dead-letters" in output and "$ kopf-reconcile status" in output
    workdir = re.search(r"workdir (\S+?)\)", output)
    assert workdir and not Path(workdir.group(1)).exists()
    # Its progress lines (not a terminal) say each figure's name, as the README explains them.
    progress = r"replica-\d (LEADER|follower|-) epoch=\d+ reconciled=\d+ accepted=\d+ stale=\d+"
    assert re.search(progress, output), output


def test_sharded_demo_moves_only_the_killed_replicas_shards() -> None:
    options = ("--shards", "8", "--objects", "24", "--ttl", "3", "--work-delay", "0.05")
    output = run_demo(*options, timeout=180)
    assert summary_value(output, "shards shared") == "8"
    assert summary_value(output, "converged") == "24"
    assert summary_value(output, "stale writes accepted") == "0"
    assert summary_value(output, "stale API writes accepted") == "0"
    assert summary_value(output, "lost updates") == "0"
    assert "every invariant held" in output
    # Three replicas shared the shards, each holding some, every shard held once.
    before = re.search(r"shards held per replica \(from their /metrics\)\n((?:  .*\n)+)", output)
    assert before, output
    held = re.findall(r"^\s+replica-\d\s+running\s+(\d+)\s+(.*)$", before.group(1), re.MULTILINE)
    assert len(held) == 3 and all(int(count) >= 1 for count, _ in held), before.group(1)
    shards = sorted(int(k) for _, listed in held for k in re.findall(r"(\d+)\(\d+\)", listed))
    assert shards == list(range(8)), before.group(1)
    # Only the killed replica's shards moved, each to a survivor at a higher epoch; every
    # other shard kept its holder and its epoch.
    killed = int(summary_value(output, "killed replica's shards"))
    assert killed >= 1
    assert summary_value(output, "shards moved") == str(killed)
    assert summary_value(output, "kept holder and epoch") == str(8 - killed)
    assert summary_value(output, "taken over at a higher epoch") == str(killed)
    table = re.search(
        r"shard holders before and after the SIGKILL of (replica-\d)\n((?:  .*\n)+)", output
    )
    assert table, output
    victim = table.group(1)
    rows = re.findall(
        r"^\s+(\d+)\s+(replica-\d) @ (\d+)\s+(replica-\d) @ (\d+)\s+(moved|kept)$",
        table.group(2),
        re.MULTILINE,
    )
    assert len(rows) == 8, table.group(2)
    for _, old, old_epoch, new, new_epoch, verdict in rows:
        if old == victim:
            assert verdict == "moved" and new != victim and int(new_epoch) > int(old_epoch)
        else:
            assert verdict == "kept" and (new, new_epoch) == (old, old_epoch)
    workdir = re.search(r"workdir (\S+?)\)", output)
    assert workdir and not Path(workdir.group(1)).exists()


def test_demo_rejects_bad_options_clearly() -> None:
    result = subprocess.run(
        [*DEMO, "--replicas", "2"], cwd=ROOT, capture_output=True, text=True, timeout=60,
        check=False,
    )  # fmt: skip
    assert result.returncode == 2
    assert "--replicas must be >= 3" in result.stderr
    result = subprocess.run(
        [*DEMO, "--shards", "0"], cwd=ROOT, capture_output=True, text=True, timeout=60,
        check=False,
    )  # fmt: skip
    assert result.returncode == 2
    assert "--shards must be from 1 to 64" in result.stderr


def _processes() -> dict[int, str]:
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                found[int(entry.name)] = (
                    (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                )
            except OSError:
                continue
    return found


def test_interrupted_demo_leaves_no_process_or_directory_behind() -> None:
    before = _processes()
    # A temporary directory of its own (short: PostgreSQL's socket path must fit), so other
    # runs' directories are not taken for the demo's leftovers.
    temp = Path(tempfile.mkdtemp(prefix="kr-demo-"))
    entries_before = set(temp.iterdir())
    demo = subprocess.Popen(
        [*DEMO, "--objects", "20", "--ttl", "2"],
        cwd=ROOT,
        env={**os.environ, "TMPDIR": str(temp)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert demo.stdout is not None
        deadline = time.monotonic() + 120
        lines: list[str] = []
        while time.monotonic() < deadline:
            line = demo.stdout.readline()
            lines.append(line)
            if "replicas of" in line or not line:
                break
        assert any("replicas of" in line for line in lines), "".join(lines)
        started = {
            pid: cmd
            for pid, cmd in _processes().items()
            if pid not in before and ("kopf_reconcile" in cmd or "postgres" in cmd)
        }
        assert len(started) >= 5, started  # the demo, the cluster, 3 replicas (+ PostgreSQL)
        demo.send_signal(signal.SIGINT)
        rest, _ = demo.communicate(timeout=60)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
    output = "".join(lines) + rest
    assert demo.returncode == 130, output
    assert "interrupted" in output
    deadline = time.monotonic() + 10
    alive = started
    while alive and time.monotonic() < deadline:
        now = _processes()
        alive = {pid: cmd for pid, cmd in started.items() if now.get(pid) == cmd}
        time.sleep(0.1)
    assert not alive, f"left running: {alive}"
    left = {p for p in set(temp.iterdir()) - entries_before if os.path.exists(p)}
    assert not left, f"left behind: {left}"
    temp.rmdir()
