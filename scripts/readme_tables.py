"""Copy the benchmark tables of benchmarks/RESULTS.md into the README (``make bench`` runs it).

The README's benchmark tables are never edited by hand: between its two markers
(:data:`BEGIN`, :data:`END`) it holds, generated from RESULTS.md, the side-by-side
section (kopf-reconcile, plain kopf and controller-runtime end to end, failover,
stale writes after a takeover) and the table of every figure with its baseline,
ratio, target and verdict. ``scripts/bench.py`` runs this after writing RESULTS.md;
``tests/unit/test_readme_tables.py`` checks that the README matches RESULTS.md.

    python scripts/readme_tables.py [--check]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
BEGIN = "<!-- generated from benchmarks/RESULTS.md by scripts/readme_tables.py: do not edit -->"
END = "<!-- end of the tables generated from benchmarks/RESULTS.md -->"
SIDE_BY_SIDE = "## Side by side with controller-runtime"


def section(results: str, heading: str) -> list[str]:
    """The lines under ``heading`` (a ``## `` line) up to the next ``## `` heading."""
    lines = results.splitlines()
    if heading not in lines:
        return []
    start = lines.index(heading) + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("## ")), len(lines))
    return lines[start:end]


def figures_table(results: str) -> list[str]:
    """RESULTS.md's first table (every figure against its baseline)."""
    lines = results.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("| benchmark |")), None)
    if start is None:
        return []
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return lines[start:end]


def generated(results: str) -> list[str]:
    """What goes between the README's markers, from the text of RESULTS.md."""
    written = next((line for line in results.splitlines() if line.startswith("Written by")), "")
    when = written.split(" on ", 1)[1].split(",", 1)[0] if " on " in written else "?"
    out = [
        f"From the `make bench` run of {when} ([benchmarks/RESULTS.md](benchmarks/RESULTS.md)).",
        "",
    ]
    side = [line.replace("### ", "#### ", 1) if line.startswith("### ") else line
            for line in section(results, SIDE_BY_SIDE)]  # fmt: skip
    if side:
        out += ["### Side by side with controller-runtime", "", *side]
        while out and not out[-1]:
            out.pop()
        out.append("")
    table = figures_table(results)
    if table:
        out += ["### Every figure against its baseline", "", *table]
    return out


def updated(readme: str, results: str) -> str:
    """``readme`` with the text between its markers generated from ``results``."""
    lines = readme.splitlines()
    if BEGIN not in lines or END not in lines:
        raise ValueError(f"the README has no {BEGIN!r} ... {END!r} markers")
    start, end = lines.index(BEGIN), lines.index(END)
    if end < start:
        raise ValueError("the README's end marker comes before its begin marker")
    return "\n".join([*lines[: start + 1], *generated(results), *lines[end:]]) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the README is stale")
    args = parser.parse_args()
    readme, results = README.read_text(), RESULTS.read_text()
    new = updated(readme, results)
    if args.check:
        if new != readme:
            print("README.md's benchmark tables differ from benchmarks/RESULTS.md", file=sys.stderr)
            return 1
        return 0
    if new != readme:
        README.write_text(new)
        print(f"updated {README.relative_to(ROOT)} from {RESULTS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
