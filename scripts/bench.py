"""Run every benchmark and write benchmarks/RESULTS.md (what ``make bench`` does).

Each benchmark in ``benchmarks/`` prints its own report and, at the end, one
``RESULT {json}`` line per figure: every run's value for this project ("ours") and for
its baseline measured in the same run, how the ratio is taken, and the target. This
script runs them one after another (their output goes to the terminal as it comes),
collects those lines and writes one page: for each figure the median and range of
both sides, the ratio, the target, and whether it is met or by how much it is missed
(with what bounds it, for the known misses), the machine, and each benchmark's full
report. The settings below keep the whole run near 16 minutes on two cores.

    python scripts/bench.py [--only NAME[,NAME...]] [--output PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"


@dataclasses.dataclass
class Benchmark:
    name: str
    args: list[str]
    timeout: float  # seconds


SIDE_BY_SIDE = "Side by side with controller-runtime"
NEEDS_BASELINE = {"kopf_e2e", "side_by_side"}

# Sizes chosen for a run of about 16 minutes; each file's --help has the full-size options.
PLAN = [
    Benchmark("dispatch", [], 240),  # with the Loop's CPU share, from kopf_e2e
    Benchmark("takeover", ["--runs", "3", "--plot", "benchmarks/takeover.png"], 180),
    Benchmark("memory", [], 120),
    Benchmark("cache_memory", [], 120),
    Benchmark("owned_children", [], 120),
    Benchmark("fenced_writes", [], 180),
    Benchmark("api_fence", ["--writes", "400", "--rounds", "2"], 240),  # the real tier
    Benchmark("failover", ["--runs", "2", "--default-runs", "1"], 300),
    Benchmark("leases", ["--seconds", "12"], 240),
    Benchmark("kopf_e2e", ["--devices", "1000", "--rounds", "2"], 420),
    Benchmark("kopf_e2e", ["--devices", "10000", "--rounds", "1"], 600),  # CPU-heavy
    Benchmark("kopf_e2e", ["--devices", "30000", "--rounds", "1"], 720),  # CPU-heavy
    Benchmark("follower", ["--devices", "10000", "--idle-seconds", "10"], 300),
    Benchmark("cluster", ["--requests", "20000"], 180),
    Benchmark("sharded_throughput", ["--runs", "2"], 300),
    Benchmark("sharded_replicas", ["--objects", "10000", "30000", "--runs", "1"], 600),
    Benchmark("side_by_side", ["--runs", "1", "--default-runs", "1", "--rounds", "2"], 420),
]

# The side-by-side tables (``TABLE`` lines): their headings and what bounds their figures.
TABLES = {
    "end_to_end": (
        "End to end: kopf-reconcile, plain kopf and controller-runtime",
        "`benchmarks/kopf_e2e.py`: the same Device operator three ways, the same Devices "
        "created on the embedded API, one embedded PostgreSQL; medians of the rounds. What "
        "bounds each figure: **time to converge** is bounded by the machine (the last row: "
        "the embedded API server, PostgreSQL and the driver share the two cores with the "
        "operator, so near 2 cores busy the time measures the harness as much as the "
        "operator); **operator CPU per Device** is the operator's own work (for "
        "kopf-reconcile its reconcile, the fenced write, the status patch and the watch "
        "stream's feed into its cache; controller-runtime's is compiled Go); **RSS growth "
        "per Device** is the peak resident set over the run less the one after the warm-up "
        "(coarse and allocator-dependent: Go's heap grows by doubling under its GC target, "
        "Python's keeps what it freed); **API requests per Device** are counted by the "
        "API server (one status patch each is the floor; plain kopf also patches its "
        "finalizer and its progress annotations)",
    ),
    "failover": (
        "Failover: from the event to the new leader's first reconcile",
        "`benchmarks/side_by_side.py --only failover`: two replicas of each framework's "
        "Device operator on one Lease. At the defaults both frameworks use client-go's "
        "lease of 15 s renewed every 2 s; at the matched lease both use the TTL and renew "
        "interval of `benchmarks/failover.py` (controller-runtime by its flags, its renew "
        "deadline 2/3 of the lease as the project's). A SIGKILL is bounded by the lease: "
        "nothing can tell a dead leader from a slow one before it lapses (the follower "
        "counts it from when it last saw the record change, so either may come in a "
        "little under the TTL). A graceful stop is bounded by how the follower learns of "
        "the release: controller-runtime (with `LeaderElectionReleaseOnCancel`) only at "
        "its next retry period, kopf-reconcile at once (a wake-up on the released Lease)",
    ),
    "stale_writes": (
        "Writes after a takeover: stale writes accepted",
        "The chaos harness's zombie fault, one schedule for both: the leader is SIGSTOPped "
        "in the middle of its reconciles (each does simulated device I/O before its "
        "writes), past its lease; the Devices change again, the peer takes over, then the "
        "paused leader gets SIGCONT. Counted: the deposed leader's writes applied after "
        "the takeover (PostgreSQL by the writing connection's application_name, the API "
        "by the kernel's owner of the writing connection), and what they leave wrong at "
        "the end. controller-runtime's client-go election does not fence: its deposed "
        "leader finishes the reconciles it was in, and the status it writes does not "
        "change the generation, so nothing reconciles those Devices again before a "
        "resync. kopf-reconcile's deposed leader has its writes refused: by its own lease "
        "check, by the database's epoch check, and by the API server's fence (installed as "
        "the chart installs it), which refuses a status patch made under a Lease that has "
        "changed hands",
    ),
}

# What bounds a figure that misses its target (shown only when it misses), by benchmark,
# or by (benchmark, a word of the figure) where figures of one benchmark differ.
WHY: dict[str | tuple[str, str], str] = {
    ("kopf_e2e", "RSS"): (
        "peak RSS growth is a coarse, allocator-dependent measure: at 1,000 Devices the "
        "peak is kopf's short-lived per-object worker tasks, at 10,000 what stays per "
        "object (the shim's cache keeps bodies pickled, about 0.4 KB each, and the relist "
        "tracker only identities); a miss here is the run's noise or a regression"
    ),
    "dispatch": (
        "the Loop's share is its worker switch, queue, timers and metrics per reconcile "
        "(the samples by owner in the kopf_e2e report); a miss here is a regression of "
        "the Loop or a run whose samples are too few to tell"
    ),
    ("sharded_replicas", "peak RSS"): (
        "what a replica's peak grows by beside its cache: a page of the listing (500 "
        "objects) decoded at once and the interpreter's arenas, a few MB whatever the "
        "shard's size, so the ratio nears 1/4 as the objects grow (0.34-0.35x at 10,000 and "
        "0.29x at 30,000 in a run with the gate)"
    ),
    "sharded_throughput": (
        "the CPU the replica processes get: on a machine shared with other work two "
        "replicas get well under two cores (the figure's extra columns give the cores "
        "they had, measured from their own CPU time); the speedup follows the ratio of "
        "the cores the two runs got, the objects split evenly between the replicas"
    ),
    "api_fence": (
        "the API server's own work per write. Impersonation alone costs about 5 % (the "
        "'impersonation alone' figure: four RBAC checks, of the user and of each extra). "
        "The policy costs the rest: for every write its match constraint covers (every "
        "resource and subresource), the API server first collects the binding's parameters "
        "(the namespace's kopf-reconcile Leases) and evaluates the match condition for each, "
        "then, for a fenced write, the validation; so others' writes pay part of it too. "
        "Narrowing the policy to the resources the operator writes would spare them, at the "
        "price of a fenced write to an unlisted resource passing unchecked: it covers every "
        "resource. The API server shares the 2-core machine with the client; the rates "
        "vary between rounds (see the ranges)"
    ),
    "fenced_writes": (
        "a fenced write does more than the raw upsert (a shared lock on the scope's epoch "
        "row and two epoch checks), and one through a Loop also pays the Loop's dispatch "
        "and the writer's lease check (client CPU per write in the report); on a shared "
        "machine the rounds vary widely (see the range; the best round is in the report). "
        "With 8 writes in flight the client process is the bound (about one core at "
        "100-190 us of client CPU per write, in the report), and on a 2-core VM the raw "
        "upsert alone varies up to 2x between rounds of one run"
    ),
    "kopf_e2e": (
        "time to converge is bounded by the machine, not the operator: until the shim's "
        "last state is stored nearly both cores are busy (the extra column: the embedded API "
        "server, PostgreSQL and the driver share them with the operator), so the time "
        "measures the harness as much as the shim, and the operator CPU per Device is the fair "
        "comparison (met); the shim's CPU per Device is its reconcile (the example's "
        "PostgreSQL write and status patch), socket writes and the watch stream's feed "
        "into the cache (kopf's per-object handling is bypassed when the shim is the "
        "resource's only consumer)"
    ),
}


@dataclasses.dataclass
class Figure:
    benchmark: str
    figure: str
    ours: list[float]
    baseline: list[float]
    unit: str
    ratio_kind: str
    target: tuple[str, float] | None
    applies_to: str
    extra: dict[str, float]

    @classmethod
    def parse(cls, data: dict[str, Any]) -> Figure:
        target = data.get("target")
        return cls(
            benchmark=data["benchmark"],
            figure=data["figure"],
            ours=[float(v) for v in data["ours"]],
            baseline=[float(v) for v in data["baseline"]],
            unit=data.get("unit", ""),
            ratio_kind=data.get("ratio", "ours/baseline"),
            target=None if target is None else (str(target[0]), float(target[1])),
            applies_to=data.get("target_applies_to", "ratio"),
            extra={k: float(v) for k, v in (data.get("extra") or {}).items()},
        )

    @property
    def ratio(self) -> float:
        ours, base = statistics.median(self.ours), statistics.median(self.baseline)
        if self.ratio_kind == "baseline/ours":
            return base / ours if ours else float("inf")
        return ours / base if base else float("inf")

    def judged(self) -> float:
        if self.applies_to == "ours_max":
            return max(self.ours)
        if self.applies_to == "ours_median":
            return statistics.median(self.ours)
        return self.ratio

    def verdict(self) -> tuple[bool | None, str]:
        if self.target is None:
            return None, "no target (reported)"
        op, goal = self.target
        value = self.judged()
        what = "ratio" if self.applies_to == "ratio" else self.applies_to.replace("ours_", "")
        shown = f"{what} {number(value)}{'x' if what == 'ratio' else ' ' + self.unit}"
        met = value >= goal if op == ">=" else value <= goal
        if met:
            return True, f"met ({shown})"
        factor = goal / value if op == ">=" else value / goal
        return False, f"missed by {factor:.2f}x ({shown})"

    def target_text(self) -> str:
        if self.target is None:
            return "-"
        op, goal = self.target
        suffix = "x" if self.applies_to == "ratio" else f" {self.unit}"
        where = "" if self.applies_to == "ratio" else f" ({self.applies_to.replace('ours_', '')})"
        return f"{op} {number(goal)}{suffix}{where}"


def number(value: float) -> str:
    if math.isnan(value):
        return "n/a"
    magnitude = abs(value)
    if magnitude >= 1000:
        return f"{value:,.0f}"
    if magnitude >= 10:
        return f"{value:.1f}"
    if magnitude >= 0.0001 or value == 0:
        return f"{value:.3g}"
    return f"{value:.2e}"


def spread(values: list[float], unit: str) -> str:
    median = number(statistics.median(values))
    unit = f" {unit}" if unit and not unit.startswith("/") else unit
    if len(values) == 1:
        return f"{median}{unit}"
    return f"{median}{unit} ({number(min(values))} to {number(max(values))}, n={len(values)})"


def machine() -> list[str]:
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory = ""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                memory = f", {int(line.split()[1]) / 2**20:.1f} GiB RAM"
    except OSError:
        pass
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    # What this run writes (the results page, the plot) is not a local change to the code.
    outputs = [":!benchmarks/RESULTS.md", ":!benchmarks/*.png"]
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--", ".", *outputs],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    return [
        f"- machine: {model}, {os.cpu_count()} CPUs{memory}; {platform.platform()}",
        f"- Python {platform.python_version()}; load average at the start: {load}",
        f"- commit {commit or 'unknown'}{' with local changes' if dirty else ''}",
    ]


@dataclasses.dataclass
class Table:
    columns: list[str]
    rows: list[list[str]]


def run(benchmark: Benchmark) -> tuple[str, list[Figure], float, str]:
    """Run one benchmark, echoing its output; (output, figures, seconds, failure or '').

    Its ``TABLE`` lines stay in the output (``tables`` reads them from there)."""
    argv = [sys.executable, str(BENCHMARKS / f"{benchmark.name}.py"), *benchmark.args]
    print(f"== {benchmark.name} {' '.join(benchmark.args)}", flush=True)
    started = time.monotonic()
    lines: list[str] = []
    failure = ""
    with subprocess.Popen(
        argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as process:
        watchdog = threading.Timer(benchmark.timeout, process.kill)
        watchdog.start()
        try:
            assert process.stdout is not None
            for line in process.stdout:
                if not line.startswith(("RESULT ", "TABLE ")):
                    print(line, end="", flush=True)
                lines.append(line.rstrip("\n"))
            code = process.wait()
        finally:
            watchdog.cancel()
    if time.monotonic() - started >= benchmark.timeout:
        failure = f"stopped after {benchmark.timeout:.0f}s"
    elif code:
        failure = f"exited with status {code}"
    figures = [Figure.parse(json.loads(line[7:])) for line in lines if line.startswith("RESULT ")]
    report = "\n".join(line for line in lines if not line.startswith("RESULT "))
    return report, figures, time.monotonic() - started, failure


def tables(reports: list[str]) -> dict[str, Table]:
    """The ``TABLE`` lines of every report, the rows of one name joined in the order they came."""
    joined: dict[str, Table] = {}
    for report in reports:
        for line in report.splitlines():
            if line.startswith("TABLE "):
                data = json.loads(line[6:])
                table = joined.setdefault(data["table"], Table(data["columns"], []))
                table.rows += data["rows"]
    return joined


def side_by_side(found: dict[str, Table]) -> list[str]:
    """RESULTS.md's side-by-side section (also the README's, by scripts/readme_tables.py)."""
    if not found:
        return []
    out = [f"## {SIDE_BY_SIDE}", ""]
    for name, (title, note) in TABLES.items():
        if name not in found:
            continue
        table = found[name]
        out += [f"### {title}", ""]
        out.append("| " + " | ".join(table.columns) + " |")
        out.append("|" + "---|" * len(table.columns))
        out += ["| " + " | ".join(row) + " |" for row in table.rows]
        out += ["", note + ".", ""]
    return out


def write(path: Path, results: list[tuple[Benchmark, str, list[Figure], float, str]]) -> None:
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    total = sum(r[3] for r in results)
    out = [
        "# Benchmark results",
        "",
        f"Written by `make bench` (`scripts/bench.py`) on {now}, in {total / 60:.1f} minutes. "
        "Every figure compares this project with its baseline measured in the same run "
        "(median and range of the runs). Figures on a machine shared with other work "
        "vary from run to run; compare the ratios, not absolute values across machines.",
        "",
        *machine(),
        "",
        "| benchmark | figure | this project | baseline | ratio | target | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    misses: dict[str | tuple[str, str], list[str]] = {}
    for benchmark, _, _, _, failure in results:
        if failure:
            out.append(f"| {benchmark.name} | (did not finish: {failure}) | | | | | |")
    everything = [f for _, _, figures, _, _ in results for f in figures]
    order = list(dict.fromkeys(f.benchmark for f in everything))  # grouped by benchmark
    for f in sorted(everything, key=lambda f: order.index(f.benchmark)):
        met, verdict = f.verdict()
        if met is False:
            specific = [k for k in WHY if isinstance(k, tuple) and k[0] == f.benchmark]
            key = next((k for k in specific if k[1] in f.figure), f.benchmark)
            misses.setdefault(key, []).append(f.figure)
        extras = "".join(f"; {k}: {number(v)}" for k, v in f.extra.items())
        out.append(
            f"| {f.benchmark} | {f.figure}{extras} | {spread(f.ours, f.unit)} | "
            f"{spread(f.baseline, f.unit)} | {number(f.ratio)}x ({f.ratio_kind}) | "
            f"{f.target_text()} | {'**' + verdict + '**' if met is False else verdict} |"
        )
    out += ["", *side_by_side(tables([r[1] for r in results]))]
    if misses:
        out += ["## Missed targets: what bounds them", ""]
        for key, figures in misses.items():
            name = key[0] if isinstance(key, tuple) else key
            why = WHY.get(key, "not analysed yet")
            out.append(f"- **{name}** ({'; '.join(figures)}): {why}.")
    out += ["", "## Reports", ""]
    for benchmark, report, _, seconds, failure in results:
        status = f", {failure}" if failure else ""
        out += [
            f"### {benchmark.name} ({seconds:.0f} s{status})",
            "",
            f"`{' '.join(['python', f'benchmarks/{benchmark.name}.py', *benchmark.args])}`",
            "",
            "```",
            "\n".join(line for line in report.splitlines() if not line.startswith("TABLE ")),
            "```",
            "",
        ]
        # A plot the benchmark drew (``plot: PATH`` from the project root), shown here.
        plots = [ROOT / line[6:] for line in report.splitlines() if line.startswith("plot: ")]
        out += [
            f"![{benchmark.name}]({plot.relative_to(path.parent)})\n"
            for plot in plots
            if plot.is_relative_to(path.parent)
        ]
    path.write_text("\n".join(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated benchmark names")
    parser.add_argument("--output", type=Path, default=BENCHMARKS / "RESULTS.md")
    args = parser.parse_args()
    chosen = set(filter(None, args.only.split(",")))
    unknown = chosen - {b.name for b in PLAN}
    if unknown:
        parser.error(f"unknown benchmarks: {', '.join(sorted(unknown))}")
    if not chosen or chosen & NEEDS_BASELINE:
        started = time.monotonic()
        print("== the controller-runtime baseline (built from source once, then cached)")
        subprocess.run([sys.executable, str(BENCHMARKS / "baselines" / "build.py")], check=True)
        print(f"baseline ready in {time.monotonic() - started:.0f} s (not counted)", flush=True)
    results = []
    for benchmark in PLAN:
        if chosen and benchmark.name not in chosen:
            continue
        report, figures, seconds, failure = run(benchmark)
        results.append((benchmark, report, figures, seconds, failure))
    write(args.output, results)
    print(f"wrote {args.output}")
    if args.output.resolve() == (BENCHMARKS / "RESULTS.md").resolve():
        subprocess.run([sys.executable, str(ROOT / "scripts" / "readme_tables.py")], check=True)
    if any(r[4] for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
