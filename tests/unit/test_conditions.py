"""Status conditions kept as meta.SetStatusCondition keeps them."""

from __future__ import annotations

import datetime

import pytest

import kopf_reconcile as kr

T0 = datetime.datetime(2026, 1, 2, 3, 4, 5, 678, tzinfo=datetime.UTC)
T1 = T0 + datetime.timedelta(minutes=5)


def test_a_new_condition_is_appended_with_its_transition_time_and_generation() -> None:
    conditions, changed = kr.set_status_condition(
        [{"type": "Other", "status": "True"}],
        {"type": "Ready", "status": "False", "reason": "Starting"},
        generation=3,
        now=T0,
    )
    assert changed
    assert conditions[1] == {
        "type": "Ready",
        "status": "False",
        "reason": "Starting",
        "message": "",
        "observedGeneration": 3,
        "lastTransitionTime": "2026-01-02T03:04:05Z",
    }
    assert conditions[0] == {"type": "Other", "status": "True"}


def test_the_transition_time_moves_only_when_the_status_changes() -> None:
    first, _ = kr.set_status_condition(None, {"type": "Ready", "status": "False"}, now=T0)
    same, changed = kr.set_status_condition(
        first, {"type": "Ready", "status": "False", "reason": "Still"}, now=T1
    )
    assert changed and same[0]["lastTransitionTime"] == "2026-01-02T03:04:05Z"
    assert same[0]["reason"] == "Still"
    flipped, changed = kr.set_status_condition(same, {"type": "Ready", "status": "True"}, now=T1)
    assert changed and flipped[0]["lastTransitionTime"] == "2026-01-02T03:09:05Z"
    again, changed = kr.set_status_condition(flipped, {"type": "Ready", "status": "True"}, now=T1)
    assert not changed and again == flipped


def test_the_given_list_is_left_as_it_was() -> None:
    before = [{"type": "Ready", "status": "False"}]
    kr.set_status_condition(before, {"type": "Ready", "status": "True"}, now=T0)
    assert before == [{"type": "Ready", "status": "False"}]


@pytest.mark.parametrize(
    ("condition", "problem"),
    [
        ({"status": "True"}, "non-empty string 'type'"),
        ({"type": "Ready", "status": "yes"}, "'status' must be one of True, False, Unknown"),
    ],
)
def test_a_bad_condition_is_refused_by_name(condition: dict[str, str], problem: str) -> None:
    with pytest.raises(kr.ConfigError, match=problem):
        kr.set_status_condition([], condition)
