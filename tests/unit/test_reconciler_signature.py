"""A reconciler that cannot take one Request is refused where it is written, not at run time."""

from __future__ import annotations

from typing import Any

import kopf
import pytest

import kopf_reconcile as kr


async def reconcile_website(spec: Any, name: str, **kwargs: Any) -> None:  # kopf's style
    pass


async def reconcile_keywords_only(**kwargs: Any) -> None:
    pass


def reconcile_two(req: kr.Request, other: Any) -> None:
    pass


@pytest.mark.parametrize("fn", [reconcile_website, reconcile_keywords_only, reconcile_two])
def test_the_decorator_refuses_a_kopf_style_signature(fn: Any) -> None:
    with pytest.raises(kr.ConfigError) as raised:
        kr.reconciler(
            "example.com",
            "v1",
            "websites",
            tenancy=kr.Tenancy.TENANT_SCOPED,
            registry=kopf.OperatorRegistry(),
        )(fn)
    message = str(raised.value)
    assert f"reconciler {fn.__name__!r} must accept one argument, the kr.Request" in message
    assert "kr.cached(req)" in message


def test_the_builder_refuses_it_too() -> None:
    with pytest.raises(kr.ConfigError, match="reconcile_website"):
        kr.Builder(reconcile_website, kr.Tenancy.SINGLE_TENANT).build()


class Reconciler:
    async def reconcile(self, req: kr.Request, *extra: Any, **options: Any) -> None:
        pass


async def reconcile_with_default(req: kr.Request, retries: int = 3) -> None:
    pass


@pytest.mark.parametrize("target", [Reconciler(), reconcile_with_default, lambda req: None])
def test_one_request_and_optional_arguments_are_accepted(target: Any) -> None:
    kr.reconciler(
        "example.com",
        "v1",
        "websites",
        tenancy=kr.Tenancy.TENANT_SCOPED,
        reconciler_id="websites-operator",
        registry=kopf.OperatorRegistry(),
    )(target)
