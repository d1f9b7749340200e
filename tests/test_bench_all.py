"""`colocar bench all`: the table assembled from the benchmarks' JSON results, a benchmark that
fails or times out reported as an error while the others are shown, and one real run.

Nothing here asserts a speed: the summary is checked against the results it was given, and
the real run (transfer, the fastest benchmark) only for its shape.
"""

from __future__ import annotations

import json
import subprocess
import sys

from test_benchmarks import TEXT, _result

from colocar.bench import run, suite
from colocar.bench.summary import HEADLINES, Goal, assemble, render, rows

RPC = {"socket_ratio": 9.1, "future_socket_ratio": 5.5, "ratio": 0.4, "p50_us": 58.0, "socket_p50_us": 6.4}
POOL = {"throughput_ratio": 0.85, "p99_ratio": 0.7, "alone_p99_us": 200.0}
RECOVERY = {
    "snapshot_blocked_s": 0.157,
    "snapshot_blocked_goal_s": 0.185,
    "small_snapshot_blocked_s": 0.0014,
    "small_blocked_goal_s": 0.00113,
    "ram_read_memcpy_ratio": 0.94,
    "slowdown_ratio": 0.93,
    "speedup": 2.6,
    "orbax_speedup": 5.4,
    "goodput": 0.41,
    "memcpy_s": 0.04,  # not a headline figure: left out of the summary
}


def test_every_benchmark_has_a_headline_and_all_is_a_bench_name() -> None:
    assert set(HEADLINES) == set(run.BENCHMARKS)
    for name, headline in HEADLINES.items():
        assert headline.peer and headline.goals, name
    help_text = run._parser().format_help()
    assert "all" in help_text and "quick" in help_text


def test_the_summary_takes_each_benchmarks_figures_and_judges_its_goals() -> None:
    summary = assemble({"rpc": RPC, "pool": POOL, "recovery": RECOVERY})
    rpc, pool, recovery = (summary["benchmarks"][n] for n in ("rpc", "pool", "recovery"))
    assert list(summary["benchmarks"]) == ["rpc", "pool", "recovery"]  # the order given
    assert rpc == {**RPC, "goals_met": False, "goals_missed": ["socket_ratio <= 4.0"]}
    assert pool == {"throughput_ratio": 0.85, "p99_ratio": 0.7, "goals_met": True, "goals_missed": []}
    # a goal bounded by another figure of the run: blocked against the goal it computed
    assert recovery["goals_missed"] == ["small_snapshot_blocked_s <= small_blocked_goal_s"]
    assert "memcpy_s" not in recovery and recovery["goodput"] == 0.41
    assert summary["all_goals_met"] is False
    assert assemble({"pool": POOL})["all_goals_met"] is True
    assert json.loads(json.dumps(summary)) == summary  # what --json prints


def test_the_table_shows_each_figure_its_goal_and_the_verdict() -> None:
    summary = assemble({"rpc": RPC, "recovery": RECOVERY})
    table = {(name, figure): (value, goal, met) for name, figure, value, goal, met in rows(summary)}
    assert table["rpc", "socket_ratio"] == ("9.1", "<= 4.0", "NO")
    assert table["rpc", "future_socket_ratio"] == ("5.5", "<= 6.0", "yes")
    assert table["rpc", "p50_us"] == ("58.0", "", "")  # informative: no goal
    assert table["recovery", "snapshot_blocked_s"] == ("0.157", "<= snapshot_blocked_goal_s (0.185)", "yes")
    text = render(summary)
    assert text.count("\nrpc ") == 1 and text.count("\nrecovery ") == 1  # each named once
    assert "vs TCP ping-pong" in text and text.endswith("not all goals met")


def test_a_missing_figure_is_a_missed_goal() -> None:
    assert Goal("ratio", ">=", 0.9).met({}) is None
    entry = assemble({"transfer": {"view_ms": 1.0}})["benchmarks"]["transfer"]
    assert entry["goals_met"] is False and entry["goals_missed"] == ["ratio >= 0.9"]
    assert ("transfer", "ratio", "-", ">= 0.9", "missing") in rows(assemble({"transfer": {}}))


def test_a_failed_or_timed_out_benchmark_is_an_error_and_the_others_are_shown() -> None:
    """Real processes: one prints its JSON, one fails, one prints no JSON, one outlives the
    timeout (its process group is ended); each is reported, in order, and the run goes on."""
    programs = {
        "transfer": "import json; print('table'); print(json.dumps({'ratio': 0.95, 'view_ms': 1.2}))",
        "rpc": "import sys; print('Traceback: boom', file=sys.stderr); sys.exit(3)",
        "pool": "print('a table but no JSON')",
        "ckpt": "import time; time.sleep(60)",
        "loader": "import json; print(json.dumps({'transfer_ratio': 3.5}))",
    }
    results = suite.run_all(list(programs), 2.0, lambda name: [sys.executable, "-c", programs[name]])
    assert results["transfer"] == {"ratio": 0.95, "view_ms": 1.2}
    assert results["rpc"] == {"error": "exit status 3: Traceback: boom"}
    assert results["pool"] == {"error": "no JSON object on the last line of its output"}
    assert results["ckpt"] == {"error": "timed out after 2 s"}
    assert results["loader"] == {"transfer_ratio": 3.5}  # ran after the one that timed out
    summary = assemble(results)
    assert summary["benchmarks"]["ckpt"] == {"error": "timed out after 2 s"}
    assert summary["benchmarks"]["transfer"]["goals_met"] is True
    assert summary["all_goals_met"] is False
    table = rows(summary)
    assert ("ckpt", "error", "timed out after 2 s", "", "NO") in table
    assert ("transfer", "ratio", "0.95", ">= 0.9", "yes") in table


def test_only_names_known_benchmarks() -> None:
    assert suite._names("") == list(HEADLINES)
    assert suite._names("pool, rpc") == ["pool", "rpc"]
    for bad in ("nope", ","):
        try:
            suite._names(bad)
        except SystemExit as e:
            assert "--only" in str(e)
        else:
            raise AssertionError(f"--only {bad!r} was accepted")


def test_bench_all_runs_the_fastest_benchmark_for_real() -> None:
    """`colocar bench all --quick --json --only transfer`: the table, then one JSON object on the
    last line with transfer's headline figures (one round: the shape is checked, not speed)."""
    cli = [sys.executable, "-c", "from colocar.cli import main; main()", "bench", "all"]
    done = subprocess.run([*cli, "--quick", "--json", "--only", "transfer", "--repeats", "1"], **TEXT)
    summary = _result("all", done.returncode, done.stdout, done.stderr)
    assert list(summary) == ["benchmarks", "all_goals_met"] and list(summary["benchmarks"]) == ["transfer"]
    transfer = summary["benchmarks"]["transfer"]
    assert "error" not in transfer, transfer
    for key in ("ratio", "view_ms", "device_put_ms"):
        assert isinstance(transfer[key], float) and transfer[key] > 0, (key, transfer)
    assert transfer["goals_met"] is (transfer["ratio"] >= 0.9) is summary["all_goals_met"]
    assert any(line.split()[:2] == ["transfer", "ratio"] for line in done.stdout.splitlines()), done.stdout
    assert "colocar bench all: transfer: done" in done.stderr
