"""The leadership analysis of the process chaos: intervals, pauses, overlaps."""

from __future__ import annotations

import json
from pathlib import Path

from kopf_reconcile.testing.chaos.leadership import (
    ProcessHistory,
    epochs_led_twice,
    intervals,
    max_overlap,
)

SCOPE = "devices"
DEADLINE = 2.0  # the renew deadline
GRACE = 1.0


def history(tmp_path: Path, name: str, events: list[tuple[str, float, int]]) -> ProcessHistory:
    path = tmp_path / f"{name}.events"
    lines = [
        json.dumps({"event": e, "t": t, "pid": 1, "reconciler": SCOPE, "holder": name, "epoch": n})
        for e, t, n in events
    ]
    path.write_text("\n".join(lines) + "\n" + '{"event": "le')  # a line cut short by SIGKILL
    return ProcessHistory(replica=name, events=path)


def test_a_takeover_after_a_step_down_is_one_leader_at_a_time(tmp_path: Path) -> None:
    a = history(tmp_path, "a", [("lead", 1.0, 1), ("lose", 5.0, 1)])
    b = history(tmp_path, "b", [("lead", 5.0, 2), ("lose", 9.0, 2)])
    leaderships = intervals(a, SCOPE, DEADLINE, GRACE) + intervals(b, SCOPE, DEADLINE, GRACE)
    assert max_overlap(leaderships, effective=True)[0] == 1
    assert max_overlap(leaderships, effective=False)[0] == 1
    assert epochs_led_twice(leaderships) == {}


def test_two_leaders_at_once_are_found_with_the_witnesses(tmp_path: Path) -> None:
    a = history(tmp_path, "a", [("lead", 1.0, 1), ("lose", 6.0, 1)])
    b = history(tmp_path, "b", [("lead", 5.0, 2)])  # still leading at the end
    leaderships = intervals(a, SCOPE, DEADLINE, GRACE) + intervals(b, SCOPE, DEADLINE, GRACE)
    count, witnesses = max_overlap(leaderships, effective=True)
    assert count == 2
    assert {w.replica for w in witnesses} == {"a", "b"}


def test_a_leader_paused_past_its_deadline_leads_until_the_deadline(tmp_path: Path) -> None:
    a = history(tmp_path, "a", [("lead", 1.0, 1), ("lose", 15.0, 1)])  # noticed 5 s late
    a.pauses.append((3.0, 10.0))
    b = history(tmp_path, "b", [("lead", 7.0, 2), ("lose", 12.0, 2)])
    leaderships = intervals(a, SCOPE, DEADLINE, GRACE) + intervals(b, SCOPE, DEADLINE, GRACE)
    assert [item.effective_end for item in leaderships[:1]] == [5.0]
    assert max_overlap(leaderships, effective=False)[0] == 2  # as believed
    assert max_overlap(leaderships, effective=True)[0] == 1
    c = history(tmp_path, "c", [("lead", 4.5, 2)])  # before a's deadline: two leaders
    leaderships = intervals(a, SCOPE, DEADLINE, GRACE) + intervals(c, SCOPE, DEADLINE, GRACE)
    assert max_overlap(leaderships, effective=True)[0] == 2


def test_a_pause_the_leader_survived_excuses_nothing(tmp_path: Path) -> None:
    a = history(tmp_path, "a", [("lead", 1.0, 1), ("lose", 20.0, 1)])
    a.pauses.append((3.0, 4.5))  # shorter than the renew deadline: it may lead on
    b = history(tmp_path, "b", [("lead", 7.0, 2), ("lose", 12.0, 2)])
    leaderships = intervals(a, SCOPE, DEADLINE, GRACE) + intervals(b, SCOPE, DEADLINE, GRACE)
    assert max_overlap(leaderships, effective=True)[0] == 2


def test_a_process_killed_while_leading_leads_until_the_kill(tmp_path: Path) -> None:
    a = history(tmp_path, "a", [("lead", 1.0, 1)])
    a.killed_at = 4.0
    b = history(tmp_path, "b", [("lead", 3.5, 1)])  # and at a's epoch
    leaderships = intervals(a, SCOPE, DEADLINE, GRACE) + intervals(b, SCOPE, DEADLINE, GRACE)
    assert [item.end for item in leaderships[:1]] == [4.0]
    assert max_overlap(leaderships, effective=True)[0] == 2
    assert epochs_led_twice(leaderships) == {1: {"a", "b"}}


def test_a_process_paused_between_winning_and_leading_never_effectively_led(
    tmp_path: Path,
) -> None:
    a = history(tmp_path, "a", [("lead", 10.01, 1), ("lose", 10.05, 1)])
    a.pauses.append((2.0, 10.0))  # stopped just after its lease was granted
    b = history(tmp_path, "b", [("lead", 6.0, 2), ("lose", 12.0, 2)])
    leaderships = intervals(a, SCOPE, DEADLINE, GRACE) + intervals(b, SCOPE, DEADLINE, GRACE)
    assert max_overlap(leaderships, effective=False)[0] == 2
    assert max_overlap(leaderships, effective=True)[0] == 1
