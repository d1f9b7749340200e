"""The multi-controller soak's rounds (tests/test_soak.py): both trainers of
tests/programs/soak_multi_trainer.py start on their sidecars, restore, run to a drawn step,
then one fault: trainers killed (one or both) or sidecars replaced by empty ones (one or both).
Every trainer process ends before a round returns, also when it fails."""

from __future__ import annotations

import json
import time

from helpers import wait_for
from multi_helpers import stop, two_processes
from soak_helpers import Reader, Round

PROGRAM = "soak_multi_trainer"
FAR = 10**6  # a stop step the chaos rounds never reach


def _start(sidecars, directory: str, every: tuple[int, int], stop_at: int) -> tuple[list, list[Reader]]:
    trainers = two_processes(PROGRAM, sidecars, directory, str(every[0]), str(every[1]), str(stop_at))
    return trainers, [Reader(t) for t in trainers]


def _restored(readers: list[Reader]) -> None:
    wait_for(
        lambda: all(r.restored for r in readers) or any(r.process.poll() is not None for r in readers),
        "both trainers to restore",
        timeout=300,
    )
    assert all(r.restored for r in readers), [r.tail() for r in readers]
    assert readers[0].restored == readers[1].restored, [r.restored for r in readers]  # agreed


def _ends_by_itself(readers: list[Reader], timeout: float = 60) -> bool:
    """Whether a trainer exits by itself within `timeout` s (a lost host or peer ends it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(r.process.poll() is not None for r in readers):
            return True
        time.sleep(0.1)
    return False


def _keep_logs(directory: str, index: int, readers: list[Reader]) -> None:
    """Each round's trainer outputs, next to the checkpoint directory: what a failure reads."""
    for p, r in enumerate(readers):
        with open(f"{directory}-round{index}-process{p}.log", "w") as f:
            f.write("".join(r.lines))


def play_round(
    sidecars, directory: str, every: tuple[int, int], action: str, ahead: int, rounds: list
) -> Round:
    """One chaos round; `ahead`: how many steps after its restore the fault comes."""
    trainers, readers = _start(sidecars, directory, every, FAR)
    victim = len(rounds) % 2
    ended = False
    try:
        _restored(readers)
        target = readers[0].restored["step"] + ahead
        wait_for(
            lambda: min(r.done for r in readers) >= target, f"both trainers at step {target}", timeout=300
        )
        if action == "kill_both":
            stop(trainers)
        elif action == "kill_one":
            stop([trainers[victim]])
            ended = _ends_by_itself([readers[1 - victim]])
        else:
            for h in (victim,) if action == "replace_one" else (0, 1):
                sidecars.processes[h].kill()
                sidecars.processes[h].wait()
            ended = _ends_by_itself(readers)
    finally:
        stop(trainers)
        for r in readers:
            r.thread.join(timeout=30)
    if action.startswith("replace"):
        for h in (victim,) if action == "replace_one" else (0, 1):
            sidecars.restart_host(h, address="127.0.0.1:0")  # a new machine: empty
    for host in sidecars.hosts:  # the killed trainers' sessions lapse (this test's stays)
        wait_for(
            lambda host=host: host.stats()["sessions"] <= 2, "the killed trainers' sessions to lapse", 60
        )
    _keep_logs(directory, len(rounds), readers)
    played = Round(action, readers)
    played.survivor_ended = ended
    where = f"restored {played.restored} ({played.tier}), {action} at {played.done}"
    print(f"[soak multi] round {len(rounds)}: {where}")
    return played


def finish(sidecars, directory: str, every: tuple[int, int], rounds: list[Round]) -> Round:
    """The last round: the trainers run to a stop a few steps past the last fault's step and end
    there; their digest of the final state is the data's (the test checks)."""
    stop_at = max([r.done for r in rounds] + [0]) + 5
    trainers, readers = _start(sidecars, directory, every, stop_at)
    try:
        outputs = [t.wait(timeout=600) for t in trainers]
        for r in readers:
            r.thread.join(timeout=30)
        for t, r in zip(trainers, readers, strict=True):
            assert t.returncode == 0 and any("OK {" in x for x in r.lines), r.tail()
    finally:
        stop(trainers)
        _keep_logs(directory, len(rounds), readers)
    del outputs
    last = Round("finish", readers, stop=stop_at)
    ok = next(x for x in readers[0].lines if "OK {" in x)
    last.digest = json.loads(ok.split("OK ", 1)[1])["digest"]
    return last
