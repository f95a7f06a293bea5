"""Stale API writes found in an audit log: the checker finds what it must, and only that."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kopf_reconcile.testing import api_audit


def lease(holder: str, epoch: int, code: int = 200) -> dict[str, Any]:
    return {
        "stage": "ResponseComplete",
        "verb": "update",
        "objectRef": {"resource": "leases", "apiGroup": "coordination.k8s.io", "name": "r"},
        "responseStatus": {"code": code},
        "responseObject": {
            "kind": "Lease",
            "metadata": {"namespace": "ops", "name": "r"},
            "spec": {"holderIdentity": holder, "leaseTransitions": epoch},
        },
    }


def write(holder: str, epoch: int, code: int = 200, verb: str = "patch") -> dict[str, Any]:
    extra = {
        "kopf-reconcile.io/lease": ["ops/r"],
        "kopf-reconcile.io/holder": [holder],
        "kopf-reconcile.io/epoch": [str(epoch)],
    }
    return {
        "stage": "ResponseComplete",
        "verb": verb,
        "impersonatedUser": {"username": "op", "extra": extra},
        "objectRef": {
            "resource": "devices",
            "subresource": "status",
            "namespace": "ops",
            "name": "d",
        },
        "responseStatus": {"code": code},
    }


def log(tmp_path: Path, *events: dict[str, Any]) -> Path:
    path = tmp_path / "audit.log"
    path.write_text("".join(json.dumps(e) + "\n" for e in events) + '{"cut sh')
    return path


def test_a_takeover_then_the_old_holders_refused_write_is_not_stale(tmp_path: Path) -> None:
    path = log(
        tmp_path,
        lease("a", 1),
        write("a", 1),
        lease("b", 2),
        write("a", 1, code=403),
        write("b", 2, verb="delete"),
    )
    assert api_audit.stale_api_writes(path) == []
    assert [w.code for w in api_audit.refused_api_writes(path)] == [403]
    assert len(api_audit.api_writes(path)) == 3
    assert [t.epoch for t in api_audit.lease_terms(path)] == [1, 2]


@pytest.mark.parametrize(
    "late",
    [
        pytest.param(write("a", 1), id="older-epoch"),
        pytest.param(write("x", 2), id="same-epoch-other-holder"),
    ],
)
def test_an_admitted_write_after_a_newer_term_is_stale(
    tmp_path: Path, late: dict[str, Any]
) -> None:
    path = log(tmp_path, lease("a", 1), write("a", 1), lease("b", 2), late)
    [stale] = api_audit.stale_api_writes(path)
    assert stale.seq == 3 and stale.what == "devices/status ops/d"
    with pytest.raises(AssertionError, match="stale API writes admitted"):
        api_audit.assert_no_stale_api_writes(path)


def test_a_newer_admitted_write_is_a_newer_term_too(tmp_path: Path) -> None:
    """Without the Lease's own record (a mirrored epoch written before the log began)."""
    path = log(tmp_path, write("b", 5), write("a", 4))
    assert [w.epoch for w in api_audit.stale_api_writes(path)] == [4]


def test_a_release_records_no_newer_term(tmp_path: Path) -> None:
    path = log(tmp_path, lease("a", 3), lease("", 3), lease("b", 4), write("b", 4))
    assert api_audit.stale_api_writes(path) == []


def test_a_write_naming_a_lease_never_written_is_unfenced(tmp_path: Path) -> None:
    path = log(tmp_path, write("a", 1), lease("a", 1), write("a", 1))
    assert [w.seq for w in api_audit.unfenced_api_writes(path)] == [0]


def deleted() -> dict[str, Any]:
    return {
        "stage": "ResponseComplete",
        "verb": "delete",
        "objectRef": {
            "resource": "leases",
            "apiGroup": "coordination.k8s.io",
            "namespace": "ops",
            "name": "r",
        },
        "responseStatus": {"code": 200},
    }


@pytest.mark.parametrize(
    ("events", "stale", "unfenced"),
    [
        pytest.param(
            [lease("a", 5), deleted(), lease("b", 1), write("b", 1), write("a", 5)],
            [4],
            [],
            id="recreated-lower",
        ),
        pytest.param([lease("a", 5), deleted(), write("a", 5)], [], [2], id="deleted"),
        pytest.param([lease("a", 5), lease("", 5), write("a", 5)], [2], [], id="released"),
        pytest.param([lease("a", 5), lease("x", 0), write("a", 5)], [2], [], id="edited-lower"),
        pytest.param([lease("a", 5), lease("a", 5), write("a", 5)], [], [], id="renewed"),
    ],
)
def test_every_change_of_the_lease_ends_the_term_it_held(
    tmp_path: Path, events: list[dict[str, Any]], stale: list[int], unfenced: list[int]
) -> None:
    path = log(tmp_path, *events)
    assert [w.seq for w in api_audit.stale_api_writes(path)] == stale
    assert [w.seq for w in api_audit.unfenced_api_writes(path)] == unfenced
