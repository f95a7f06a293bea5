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
    target: tuple[str, float],
    extra: dict[str, float] | None = None,
) -> None:
    """One machine-readable line for scripts/bench.py (RESULTS.md)."""
    line = {
        "benchmark": benchmark,
        "figure": figure,
        "ours": ours,
        "baseline": baseline,
        "unit": unit,
        "ratio": ratio,
        "target": list(target),
        "extra": extra or {},
    }
    print("RESULT " + json.dumps(line), flush=True)
