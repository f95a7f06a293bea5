"""The benchmark pages: side-by-side tables in RESULTS.md, and the README's copy of them.

``scripts/bench.py`` joins the ``TABLE`` lines of every benchmark's report into
RESULTS.md's side-by-side section; ``scripts/readme_tables.py`` copies that section
and the table of every figure into the README, between its markers. The README in
the repository must match the RESULTS.md next to it (``make bench`` rewrites both).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).parents[2]


def load(path: Path, name: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return load(ROOT / "scripts" / "bench.py", "bench_script", monkeypatch)


@pytest.fixture
def readme_tables(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return load(ROOT / "scripts" / "readme_tables.py", "readme_tables_script", monkeypatch)


def table_line(name: str, columns: list[str], rows: list[list[str]]) -> str:
    return "TABLE " + json.dumps({"table": name, "columns": columns, "rows": rows})


def result_line(benchmark: str, figure: str) -> str:
    data = {"benchmark": benchmark, "figure": figure, "ours": [1.0], "baseline": [2.0],
            "unit": "s", "ratio": "ours/baseline", "target": None}  # fmt: skip
    return "RESULT " + json.dumps(data)


def test_rows_of_one_table_are_joined_in_order_under_the_first_columns(bench: ModuleType) -> None:
    columns = ["Devices", "figure", "kopf-reconcile", "plain kopf", "controller-runtime"]
    first = table_line("end_to_end", columns, [["1,000", "time", "1", "2", "3"]])
    second = table_line("end_to_end", ["ignored"], [["10,000", "time", "4", "5", "6"]])
    found = bench.tables([f"a report\n{first}", f"{second}\nmore"])
    assert found["end_to_end"].columns == columns
    assert [row[0] for row in found["end_to_end"].rows] == ["1,000", "10,000"]


def test_results_page_has_the_side_by_side_section_and_no_table_lines_in_reports(
    bench: ModuleType, tmp_path: Path
) -> None:
    columns = ["deposed leader's writes", "controller-runtime", "kopf-reconcile"]
    report = "\n".join(
        [
            "stale writes: 21 vs 0",
            table_line("stale_writes", columns, [["stale writes accepted", "21", "0"]]),
            result_line("side_by_side", "stale writes accepted"),
        ]
    )
    figures = [bench.Figure.parse(json.loads(report.splitlines()[-1][7:]))]
    results = [(bench.Benchmark("side_by_side", [], 1), report, figures, 1.0, "")]
    page = tmp_path / "RESULTS.md"
    bench.write(page, results)
    text = page.read_text()
    assert f"## {bench.SIDE_BY_SIDE}" in text
    assert "| stale writes accepted | 21 | 0 |" in text
    assert "TABLE " not in text
    assert "stale writes: 21 vs 0" in text  # the report itself is kept


def test_readme_gets_the_tables_between_its_markers(readme_tables: ModuleType) -> None:
    results = "\n".join(
        [
            "# Benchmark results",
            "",
            "Written by `make bench` (`scripts/bench.py`) on 2026-12-02 10:00 UTC, in 14 minutes.",
            "",
            "| benchmark | figure | this project | baseline | ratio | target | verdict |",
            "|---|---|---|---|---|---|---|",
            "| kopf_e2e | time | 1 s | 2 s | 2x | - | no target (reported) |",
            "",
            "## Side by side with controller-runtime",
            "",
            "### Failover",
            "",
            "| lease | event | kopf-reconcile | controller-runtime |",
            "|---|---|---|---|",
            "| defaults | graceful stop | 0.02 s | 1.1 s |",
            "",
            "## Reports",
            "",
            "### kopf_e2e (1 s)",
        ]
    )
    readme = "\n".join(
        ["# Project", "before", readme_tables.BEGIN, "stale text", readme_tables.END, "after", ""]
    )
    new = readme_tables.updated(readme, results)
    assert new.startswith("# Project\nbefore\n" + readme_tables.BEGIN)
    assert new.endswith(readme_tables.END + "\nafter\n")
    assert "stale text" not in new
    assert "2026-12-02 10:00 UTC" in new
    assert "#### Failover" in new  # one level below the README's own heading
    assert "| defaults | graceful stop | 0.02 s | 1.1 s |" in new
    assert "| kopf_e2e | time | 1 s | 2 s | 2x | - | no target (reported) |" in new
    assert "### kopf_e2e (1 s)" not in new  # the reports stay in RESULTS.md
    assert readme_tables.updated(new, results) == new


def test_readme_without_markers_is_refused(readme_tables: ModuleType) -> None:
    with pytest.raises(ValueError, match="markers"):
        readme_tables.updated("# Project\n", "# Benchmark results\n")


def test_the_readme_matches_the_results_page(readme_tables: ModuleType) -> None:
    readme = (ROOT / "README.md").read_text()
    results = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    assert readme_tables.updated(readme, results) == readme, (
        "README.md's benchmark tables are stale: run `python scripts/readme_tables.py` "
        "(make bench does)"
    )
