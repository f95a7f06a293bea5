"""The shim lists in pages of 500 (as client-go's reflectors do) unless the user chose a
``settings.watching.chunk_size``: kopf would otherwise decode a whole list at once."""

from __future__ import annotations

import kopf

from kopf_reconcile.integration import kopf_shim


def test_lists_are_paged_unless_the_user_chose() -> None:
    settings = kopf.OperatorSettings()
    assert settings.watching.chunk_size is None  # kopf's own default: whole lists
    kopf_shim._paged_lists(settings)
    assert settings.watching.chunk_size == kopf_shim.LIST_PAGE == 500
    chosen = kopf.OperatorSettings()
    chosen.watching.chunk_size = 100
    kopf_shim._paged_lists(chosen)
    assert chosen.watching.chunk_size == 100
