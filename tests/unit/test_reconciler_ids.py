"""Default reconciler ids of ``@kr.reconciler``: what is reconciled, then the function; and
the refusal of a default that says only "reconcile" when a leader is configured."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import kopf
import pytest

import kopf_reconcile as kr
from kopf_reconcile.integration import kopf_shim
from kopf_reconcile.integration.settings import Settings
from kopf_reconcile.testing.memory import MemoryLeaseElector, MemoryLeaseStore

LEASE_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def registered_id(
    group: str, plural: str, fn: Callable[..., Any], **options: Any
) -> tuple[str, Any]:
    """The reconciler id ``fn`` gets as the only reconciler of an operator of its own."""
    registry = kopf.OperatorRegistry()
    kr.reconciler(
        group, "v1", plural, tenancy=kr.Tenancy.TENANT_SCOPED, registry=registry, **options
    )(fn)
    (rid,) = kopf_shim.status(registry)
    return rid, registry


async def reconcile_inventory(req: kr.Request) -> None:
    pass


async def reconcile(req: kr.Request) -> None:
    pass


def test_operators_with_one_function_name_for_two_resources_get_two_leases() -> None:
    configmaps, _ = registered_id("", "configmaps", reconcile_inventory)
    devices, _ = registered_id("example.com", "devices", reconcile_inventory)
    deployments, _ = registered_id("apps", "deployments", reconcile_inventory)
    assert configmaps == "configmaps-reconcile-inventory"
    assert devices == "devices.example.com-reconcile-inventory"
    assert deployments == "deployments.apps-reconcile-inventory"
    # The version is not part of it: v1beta1 and v1 serve the same objects.
    registry = kopf.OperatorRegistry()
    kr.reconciler(
        "example.com", "v1beta1", "devices", tenancy=kr.Tenancy.SINGLE_TENANT, registry=registry
    )(reconcile_inventory)
    assert list(kopf_shim.status(registry)) == [devices]


def test_a_long_default_id_is_shortened_with_a_digest_and_stays_a_valid_stable_name() -> None:
    group = "very-long-group-name.with.several.labels.example.com"

    async def reconcile_the_inventory_of_every_warehouse_in_every_region(req: kr.Request) -> None:
        pass

    fn = reconcile_the_inventory_of_every_warehouse_in_every_region
    first, _ = registered_id(group, "warehouseinventories", fn)
    again, _ = registered_id(group, "warehouseinventories", fn)
    other, _ = registered_id(group, "warehouseinventoriez", fn)
    assert first == again != other
    assert len(first) <= 63 and LEASE_NAME.match(first), first
    assert first.startswith("warehouseinventories.very-long-group-name")
    assert re.search(r"-[0-9a-f]{8}$", first)


def test_names_with_odd_characters_still_make_a_valid_lease_name() -> None:
    rid, _ = registered_id("example.com", "devices", reconcile_inventory, name="Team._A  sync")
    assert rid == "devices.example.com-team-a-sync"


def test_a_default_id_that_says_only_reconcile_is_refused_with_a_given_leader() -> None:
    elector = MemoryLeaseElector(MemoryLeaseStore())
    for fn in (reconcile, lambda req: None):
        with pytest.raises(kr.ConfigError, match=r"needs reconciler_id=") as raised:
            registered_id("", "configmaps", fn, leader=elector)
        assert "configmaps-" in str(raised.value)  # the lease it would have shared
    # Accepted: an explicit id, a telling name, or no leader.
    assert registered_id("", "configmaps", reconcile, leader=elector, reconciler_id="shop-cm")[0]
    assert registered_id("", "configmaps", reconcile, leader=elector, name="shop_settings")[0]
    assert registered_id("", "configmaps", reconcile, leader=None)[0] == "configmaps-reconcile"


def test_a_default_id_that_says_only_reconcile_is_refused_when_settings_pick_a_leader() -> None:
    _, registry = registered_id("", "configmaps", reconcile)
    with pytest.raises(kr.ConfigError, match=r"needs reconciler_id="):
        kopf_shim.check_reconciler_ids(
            Settings.load({"KOPF_RECONCILE_LEADER": "kubernetes"}), registry
        )
    kopf_shim.check_reconciler_ids(Settings.load({"KOPF_RECONCILE_LEADER": "none"}), registry)
    _, registry = registered_id("", "configmaps", reconcile_inventory)
    kopf_shim.check_reconciler_ids(Settings.load({"KOPF_RECONCILE_LEADER": "kubernetes"}), registry)
