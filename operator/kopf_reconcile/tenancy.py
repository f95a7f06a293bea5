"""A reconciler's declared tenant stance.

Every Loop must say whether its entity ids are globally unique
(:attr:`Tenancy.SINGLE_TENANT`: fencing keys use the tenant ``_notenant``) or
carry their tenant (:attr:`Tenancy.TENANT_SCOPED`: ids look like
``<tenant>/<id>``, and keys include that tenant). Making it a required
argument turns "forgot the tenant dimension" — two tenants silently sharing a
key — into a conscious, reviewable choice.
"""

from __future__ import annotations

import enum

NO_TENANT = "_notenant"


class MalformedEntityId(ValueError):
    """A TENANT_SCOPED entity id that is not ``<tenant>/<id>``."""


class Tenancy(enum.Enum):
    """The closed set of tenant stances."""

    SINGLE_TENANT = "single-tenant"
    TENANT_SCOPED = "tenant-scoped"

    def tenant_of(self, entity_id: str) -> str:
        """The tenant an entity id belongs to, or raise :class:`MalformedEntityId`."""
        if self is Tenancy.SINGLE_TENANT:
            return NO_TENANT
        tenant, sep, rest = entity_id.partition("/")
        if not sep or not tenant or not rest:
            raise MalformedEntityId(
                f"entity id {entity_id!r} is not '<tenant>/<id>' as TENANT_SCOPED requires"
            )
        return tenant
