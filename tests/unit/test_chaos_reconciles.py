"""The reconcile analysis of the process chaos: spans per process, overlaps across them."""

from __future__ import annotations

import json
import math
from pathlib import Path

from kopf_reconcile.testing.chaos.leadership import ProcessHistory
from kopf_reconcile.testing.chaos.reconciles import overlaps, spans

SHARD = "devices-shard-3"
DEADLINE = 2.0  # the renew deadline
GRACE = 1.0


def history(
    tmp_path: Path, name: str, events: list[tuple[str, float, str]], **known: object
) -> ProcessHistory:
    """A process that reported ``(enter|exit, t, entity)`` reconciles of shard 3."""
    events_path = tmp_path / f"{name}.events"
    lines = [
        json.dumps({"event": e, "t": t, "pid": 1, "reconciler": SHARD, "entity": entity})
        for e, t, entity in events
    ]
    spans_path = events_path.with_name(events_path.name + ".spans")
    spans_path.write_text("\n".join(lines) + "\n" + '{"event": "en')  # cut short by SIGKILL
    return ProcessHistory(replica=name, events=events_path, **known)  # type: ignore[arg-type]


def test_one_entity_reconciled_by_one_replica_after_another_is_no_overlap(tmp_path: Path) -> None:
    a = history(tmp_path, "a", [("enter", 1.0, "x"), ("exit", 2.0, "x")])
    b = history(tmp_path, "b", [("enter", 2.0, "x"), ("exit", 3.0, "x"), ("enter", 2.5, "y")])
    found = spans(a, DEADLINE, GRACE) + spans(b, DEADLINE, GRACE)
    assert len(found) == 3
    assert [s.end for s in found if s.entity == "y"] == [math.inf]  # still inside at the end
    assert overlaps(found, origin=0.0) == []


def test_two_replicas_inside_one_entity_at_once_are_named(tmp_path: Path) -> None:
    a = history(tmp_path, "a", [("enter", 1.0, "x"), ("exit", 3.0, "x")])
    b = history(tmp_path, "b", [("enter", 2.0, "x"), ("exit", 2.5, "x"), ("enter", 2.0, "y")])
    [found] = overlaps(spans(a, DEADLINE, GRACE) + spans(b, DEADLINE, GRACE), origin=0.0)
    assert "a and b both inside devices-shard-3 of x at 2.00s" in found


def test_other_shards_and_entities_do_not_overlap(tmp_path: Path) -> None:
    a = history(tmp_path, "a", [("enter", 1.0, "x"), ("exit", 3.0, "x")])
    b = history(tmp_path, "b", [("enter", 2.0, "y"), ("exit", 2.5, "y")])
    assert overlaps(spans(a, DEADLINE, GRACE) + spans(b, DEADLINE, GRACE), origin=0.0) == []


def test_a_long_pause_inside_a_reconcile_ends_it_one_renew_deadline_in(tmp_path: Path) -> None:
    # Paused at 2 for 6 s: inside x until 4 for the others, whatever it reports after.
    a = history(tmp_path, "a", [("enter", 1.0, "x"), ("exit", 8.5, "x")], pauses=[(2.0, 8.0)])
    b = history(tmp_path, "b", [("enter", 5.0, "x"), ("exit", 6.0, "x")])
    found = spans(a, DEADLINE, GRACE) + spans(b, DEADLINE, GRACE)
    assert overlaps(found, origin=0.0) == []
    # A short pause excuses nothing.
    c = history(tmp_path, "c", [("enter", 1.0, "x"), ("exit", 8.5, "x")], pauses=[(2.0, 3.0)])
    assert overlaps(spans(c, DEADLINE, GRACE) + spans(b, DEADLINE, GRACE), origin=0.0)


def test_a_killed_process_is_inside_nothing_from_the_kill(tmp_path: Path) -> None:
    a = history(tmp_path, "a", [("enter", 1.0, "x")], killed_at=2.0)
    b = history(tmp_path, "b", [("enter", 2.0, "x"), ("exit", 3.0, "x")])
    [killed] = spans(a, DEADLINE, GRACE)
    assert killed.end == 2.0
    assert overlaps([killed, *spans(b, DEADLINE, GRACE)], origin=0.0) == []
