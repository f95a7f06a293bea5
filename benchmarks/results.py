"""The ``RESULT`` line each benchmark prints for scripts/bench.py (benchmarks/RESULTS.md)."""

from __future__ import annotations

import json


def result(
    benchmark: str,
    figure: str,
    *,
    ours: list[float],
    baseline: list[float],
    unit: str,
    ratio: str,
    target: tuple[str, float] | None,
    target_applies_to: str = "ratio",
    extra: dict[str, float] | None = None,
) -> None:
    """One machine-readable line for scripts/bench.py (RESULTS.md).

    ``target`` is ``(operator, value)``, such as ``(">=", 0.5)``, or ``None`` for a
    figure reported without one; it applies to the ratio unless ``target_applies_to``
    names ``ours_median`` or ``ours_max``.
    """
    line = {
        "benchmark": benchmark,
        "figure": figure,
        "ours": ours,
        "baseline": baseline,
        "unit": unit,
        "ratio": ratio,
        "target": None if target is None else list(target),
        "target_applies_to": target_applies_to,
        "extra": extra or {},
    }
    print("RESULT " + json.dumps(line), flush=True)


def table(name: str, columns: list[str], rows: list[list[str]]) -> None:
    """Rows of a side-by-side table in RESULTS.md (scripts/bench.py joins the rows of one
    ``name`` from every run, in the order they came, under the first run's ``columns``)."""
    line = {"table": name, "columns": columns, "rows": rows}
    print("TABLE " + json.dumps(line), flush=True)
