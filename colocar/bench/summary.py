"""Where the benchmarks stand: each one's headline figures, its peer and its goals, and the
table `colocar bench all` prints from the benchmarks' JSON results (runs anywhere, no JAX).

A goal compares a figure of a benchmark's result with a number or with another figure of the
same result (`recovery`'s blocked time against the goal the run computed from its memcpy).
Where a benchmark's module defines its goals (`rpc`, `pool`) they are taken from it; the others
are those `benchmarks/RESULTS.md` measures against (the issue that set each is named). Goals are
set for the full-size runs: a `--quick` run's figures are indicative (a smaller array or state
makes a fixed cost a larger share).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from colocar.bench.pool import P99_GOAL, THROUGHPUT_GOAL
from colocar.bench.rpc import FUTURE_SOCKET_RATIO_GOAL, SOCKET_RATIO_GOAL


@dataclass(frozen=True)
class Goal:
    figure: str  # a key of the benchmark's result
    op: str  # "<=" or ">="
    bound: float | str  # a number, or another key of the same result

    def text(self) -> str:
        return f"{self.op} {self.bound}"

    def met(self, result: dict[str, Any]) -> bool | None:
        """Whether the result meets it; None when a figure it needs is missing."""
        value = result.get(self.figure)
        bound = result.get(self.bound) if isinstance(self.bound, str) else self.bound
        if not isinstance(value, int | float) or not isinstance(bound, int | float):
            return None
        return value <= bound if self.op == "<=" else value >= bound


@dataclass(frozen=True)
class Headline:
    peer: str
    goals: tuple[Goal, ...]
    informative: tuple[str, ...] = ()  # figures shown without a goal

    def figures(self) -> list[str]:
        keys = [g.figure for g in self.goals] + [g.bound for g in self.goals if isinstance(g.bound, str)]
        return list(dict.fromkeys([*keys, *self.informative]))


LE, GE = "<=", ">="
# In the order `colocar bench all` runs them (the fastest first).
HEADLINES: dict[str, Headline] = {
    "transfer": Headline(  # the goal of the first runs (RESULTS.md, "transfer"), at 256 MiB
        "np.copyto of the same bytes", (Goal("ratio", GE, 0.9),), ("view_ms", "device_put_ms")
    ),
    "rpc": Headline(  # issue 34 (the socket floor); the gRPC echo's from the first runs
        "TCP ping-pong (socket_p50_us); bare gRPC echo (ratio)",
        (
            Goal("socket_ratio", LE, SOCKET_RATIO_GOAL),
            Goal("future_socket_ratio", LE, FUTURE_SOCKET_RATIO_GOAL),
            Goal("ratio", LE, 1.2),
        ),
        ("p50_us", "socket_p50_us"),
    ),
    "recovery": Headline(  # issue 34: the copy floor; the speedups are informative on one machine
        "one memcpy of the state; a storage save; Orbax",
        (
            Goal("snapshot_blocked_s", LE, "snapshot_blocked_goal_s"),
            Goal("small_snapshot_blocked_s", LE, "small_blocked_goal_s"),
            Goal("ram_read_memcpy_ratio", LE, 1.5),
            Goal("slowdown_ratio", LE, 1.0),  # replication <= a storage save (both floored)
        ),
        ("speedup", "orbax_speedup", "goodput"),
    ),
    "pool": Headline(  # issue 35
        "tenant B alone",
        (Goal("throughput_ratio", GE, THROUGHPUT_GOAL), Goal("p99_ratio", LE, P99_GOAL)),
    ),
    "ckpt": Headline(  # the first runs' goals (RESULTS.md, "ckpt"), and issue 32's
        "Orbax async StandardCheckpointer",
        (
            Goal("blocked_ratio", LE, 1.0),
            Goal("durable_ratio", LE, 0.5),
            Goal("restore_ratio", LE, 0.5),
            Goal("train_slowdown_ratio", LE, 0.5),
            Goal("peak_host_mem_ratio", LE, 1.25),
            Goal("orbax_layout_durable_training_ratio", LE, 0.5),
            Goal("orbax_layout_train_lost_ratio", LE, 0.25),
            Goal("orbax_layout_peak_host_mem_ratio", LE, 1.25),
            Goal("orbax_written_restore_ratio", LE, 0.5),
        ),
    ),
    "loader": Headline(  # the first runs' goals (RESULTS.md, "loader")
        "grain mp_prefetch",
        (
            Goal("transfer_ratio", GE, 3.0),
            Goal("compute_ratio", GE, 0.95),
            Goal("trainer_cpu_ratio", LE, 0.25),
        ),
    ),
    "firstbatch": Headline(  # issue 19 item 8 set no number: parity (below 1, colocar is faster)
        "grain + Orbax",
        (Goal("fresh_ratio", LE, 1.0), Goal("resume_ratio", LE, 1.0), Goal("peak_rss_ratio", LE, 1.0)),
    ),
}


def summarize(name: str, result: dict[str, Any]) -> dict[str, Any]:
    """One benchmark's entry: its headline figures, `goals_met`, and the goals it missed
    (a goal whose figure is missing counts as missed)."""
    if "error" in result:
        return {"error": str(result["error"])}
    headline = HEADLINES[name]
    entry: dict[str, Any] = {key: result[key] for key in headline.figures() if key in result}
    missed = [f"{g.figure} {g.text()}" for g in headline.goals if not g.met(result)]
    entry["goals_met"] = not missed
    entry["goals_missed"] = missed
    return entry


def assemble(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """What `colocar bench all --json` prints: an entry per benchmark, in the order given."""
    benchmarks = {name: summarize(name, result) for name, result in results.items()}
    met = bool(benchmarks) and all(entry.get("goals_met") is True for entry in benchmarks.values())
    return {"benchmarks": benchmarks, "all_goals_met": met}


def _met(value: bool | None) -> str:
    return "yes" if value else "missing" if value is None else "NO"


def rows(summary: dict[str, Any]) -> list[tuple[str, str, str, str, str]]:
    """(benchmark, figure, value, goal, met) per headline figure; one row for a failed run."""
    out = []
    for name, entry in summary["benchmarks"].items():
        if "error" in entry:
            out.append((name, "error", entry["error"], "", "NO"))
            continue
        headline = HEADLINES[name]
        goals = {g.figure: g for g in headline.goals}
        for key in [g.figure for g in headline.goals] + list(headline.informative):
            goal = goals.get(key)
            value = entry.get(key, "-")
            bound = entry.get(goal.bound, "-") if goal and isinstance(goal.bound, str) else None
            goal_text = "" if goal is None else goal.text() + (f" ({bound})" if bound is not None else "")
            met = "" if goal is None else _met(goal.met(entry))
            out.append((name, key, str(value), goal_text, met))
    return out


def render(summary: dict[str, Any]) -> str:
    """The table as plain text, each benchmark named once, its peer beside it."""
    header = ("benchmark", "figure", "value", "goal", "met")
    table = rows(summary)
    body: list[tuple[str, ...]] = []
    for i, row in enumerate(table):
        first = i == 0 or table[i - 1][0] != row[0]
        body.append((row[0] if first else "", *row[1:]))
    widths = [max(len(r[c]) for r in [header, *body]) for c in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in body]
    rule = "  ".join("-" * w for w in widths)
    peers = [f"  {name}: vs {HEADLINES[name].peer}" for name in summary["benchmarks"]]
    verdict = "all goals met" if summary["all_goals_met"] else "not all goals met"
    top = "  ".join(cell.ljust(w) for cell, w in zip(header, widths, strict=True)).rstrip()
    return "\n".join(["colocar bench all (quick runs)", top, rule, *lines, rule, "peers:", *peers, verdict])
