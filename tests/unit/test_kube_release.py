"""Which Kubernetes release the real tiers run: the newest by default, another on request,
a release the tiers cannot run refused naming the variable; its feature flags."""

from __future__ import annotations

import pytest

from kopf_reconcile.testing.kube_release import (
    KUBE_RELEASES,
    RELEASE_VARIABLE,
    ReleaseError,
    apiserver_feature_flags,
    has_feature,
    kube_version,
)


def test_the_newest_release_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(RELEASE_VARIABLE, raising=False)
    assert kube_version() == KUBE_RELEASES["1.37"] == next(iter(KUBE_RELEASES.values()))


@pytest.mark.parametrize("asked", ["1.35", "v1.35", "v1.35.4", "1.35.4", " 1.35 "])
def test_a_minor_or_its_listed_patch_selects_the_listed_release(asked: str) -> None:
    assert kube_version(asked) == "v1.35.4"


@pytest.mark.parametrize("asked", ["1.35.1", "1.99", "1.20", "latest", "2"])
def test_a_release_the_tiers_cannot_run_is_refused_naming_the_variable(asked: str) -> None:
    with pytest.raises(ReleaseError, match=rf"{RELEASE_VARIABLE}=.* choose one of 1\.37"):
        kube_version(asked)


def test_feature_gates_only_where_the_release_has_them() -> None:
    assert has_feature("ShardedListAndWatch", "v1.37.2")
    assert not has_feature("ShardedListAndWatch", "v1.35.4")
    assert not has_feature("NoSuchGate", "v1.37.2")
    newest, older = apiserver_feature_flags("v1.37.2"), apiserver_feature_flags("v1.35.4")
    assert any("ShardedListAndWatch=true" in flag for flag in newest)
    assert not any("ShardedListAndWatch" in flag for flag in older)
    assert any("CoordinatedLeaderElection=true" in flag for flag in older)
