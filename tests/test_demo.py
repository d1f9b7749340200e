"""`colocar demo --quick`: the demo job end to end, as a user runs it (a subprocess): a local
cluster and fake GCS server of its own, a host killed midway, recovery from RAM, the summary
and the plot. The README's training script is the module the demo runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import psutil

from colocar.demo import scaleup

ROOT = Path(__file__).resolve().parent.parent


def _run_demo(out: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(
        [sys.executable, "-m", "colocar", "demo", "--quick", "--out", str(out), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


def _children_named(words: tuple[str, ...]) -> list[psutil.Process]:
    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            if any(w in " ".join(p.cmdline()) for w in words) and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.Error:
            pass
    return found


def test_quick_demo_recovers_from_ram_and_draws_its_plot(tmp_path, shm_dir):
    before = set(os.listdir(shm_dir))
    running = {p.pid for p in _children_named(("colocar", "fake-gcs-server"))}  # the suite's own
    result = _run_demo(tmp_path / "out")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["passed"] and summary["problems"] == []
    assert summary["restored_from"] == "snapshot" and summary["host_losses"] == 1
    assert summary["lost_hosts"] == ["host1"]
    # host1 comes back where this colocar can restart it (colocar.demo.scaleup)
    if scaleup.available():
        assert summary["scale_up"]["ran"] is True, summary["scale_up"]
        assert summary["hosts_at_end"] == ["host0", "host1", "host2", "host3"]
    else:
        assert summary["scale_up"] == {"ran": False, "reason": scaleup.SKIPPED}
        assert summary["hosts_at_end"] == ["host0", "host2", "host3"]
    assert summary["record_stream_intact"] is True
    assert summary["kill_step"] - 10 <= summary["restored_step"] <= summary["kill_step"] + 1
    assert 0 < summary["recovery_seconds"] < 120
    assert summary["steps_run"] == summary["steps"] + summary["steps_lost"]
    assert summary["loss_last"] < 0.5 * summary["loss_first"]
    assert summary["accuracy_floor"] < summary["test_accuracy"] <= 1
    assert summary["snapshots"] > 0 and summary["saves"] > 0 and summary["throughput_examples_per_s"] > 0
    assert summary["snapshot_blocked_ms"] > 0 and summary["save_blocked_ms"] > 0
    assert 0 < summary["snapshot_share"] < 1  # of the loop's wall time (speed: `colocar bench recovery`)
    assert summary["storage"].startswith("gs://colocar-demo/")
    assert "summary" in result.stdout and "demo passed" in result.stdout
    _check_png(tmp_path / "out" / "demo.png")
    assert (tmp_path / "out" / "data" / "pipeline.yaml").exists()
    # nothing left: the sidecars, their pipeline workers, the GCS server, the arenas
    assert not [p for p in _children_named(("colocar", "fake-gcs-server")) if p.pid not in running]
    assert set(os.listdir(shm_dir)) <= before


def _check_png(path: Path) -> None:
    import matplotlib.image

    assert path.stat().st_size > 20_000
    image = matplotlib.image.imread(str(path))
    assert image.ndim == 3 and image.shape[0] > 400 and image.shape[1] > 600
    rgb = image[..., :3]
    assert float(np.std(rgb)) > 0.05  # curves, lines and text, not a blank page
    assert len(np.unique((rgb * 255).astype(np.uint8).reshape(-1, 3), axis=0)) > 20  # colours


def test_each_broken_promise_fails_the_demo_with_its_message():
    """The exit status comes from `summary.checks`: recovery from storage or init, a record
    stream that differs, a loss that did not fall, an accuracy at the floor, a kill never seen:
    each one is named; a run that kept them all passes."""
    from colocar.demo.summary import checks

    good = {
        "loss_first": 2.5,
        "loss_last": 0.2,
        "test_accuracy": 0.9,
        "accuracy_floor": 0.75,
        "kill_step": 59,
        "host_losses": 1,
        "restored_from": "snapshot",
        "record_stream_intact": True,
    }
    assert checks(good) == []
    broken = {
        "restored_from": ("storage", "not from the snapshots in RAM"),
        "record_stream_intact": (False, "record stream"),
        "loss_last": (2.0, "the loss did not fall"),
        "test_accuracy": (0.75, "not above the floor"),
        "host_losses": (0, "never seen lost"),
    }
    for key, (value, message) in broken.items():
        problems = checks({**good, key: value})
        assert len(problems) == 1 and message in problems[0], (key, problems)
    assert checks({**good, "kill_step": None, "host_losses": 0, "restored_from": None}) == []


def test_the_record_stream_is_rebuilt_from_the_attempts():
    """The steps a later attempt replays replace the first attempt's; a restart past the last
    step done leaves a gap that the comparison with the reference must see."""
    from colocar.demo.monitor import Monitor, StepRecord

    def run(*attempts: tuple[int, range]) -> Monitor:
        m = Monitor(global_batch=2)
        for attempt, steps in attempts:
            m.steps += [StepRecord(attempt, s, 1.0, 0.1, [attempt, s], 0.0) for s in steps]
        return m

    m = run((1, range(0, 6)), (2, range(3, 8)))
    assert m.trained_on() == [[1, 0], [1, 1], [1, 2]] + [[2, s] for s in range(3, 8)]
    assert m.steps_lost() == 3
    gap = run((1, range(0, 4)), (2, range(6, 8)))
    assert len(gap.trained_on()) != 8


def test_getting_started_shows_the_training_module():
    """Getting started (docs/getting-started.md) holds `colocar/demo/train.py`'s `train`
    function, exactly."""
    readme = (ROOT / "docs" / "getting-started.md").read_text()
    module = (ROOT / "colocar" / "demo" / "train.py").read_text()
    function = module[module.index("def train(") :]
    marker = "<!-- colocar/demo/train.py: train -->"
    block = readme[readme.index(marker) :].split("```python\n", 1)[1].split("```\n", 1)[0]
    assert block == function
