"""The primary writer's rules for a step besides writing (runs in the sidecar): wait for every
planned host's done marker of the attempt, and after the commit apply retention and remove the
debris of crashed saves. Used by `writer.CheckpointWriter._primary`."""

from __future__ import annotations

import time
from typing import Any

from ..store.steps import StepDirs

AWAIT_HOSTS_POLL_SECONDS = 0.1  # the primary lists the done markers this often (the commit's latency)


def await_hosts(steps: StepDirs, job: Any, commit_timeout: float) -> None:
    """Until every host's done marker of this attempt exists; raises on a failure marker of
    this attempt (markers a crashed earlier save of the step left late are not ours)."""
    deadline = time.monotonic() + commit_timeout
    delay = 0.01
    done: set[int] = set()
    while True:
        with job.lock:
            if job.state == "failed":
                raise RuntimeError(job.error)
        failure = steps.failure(job.step, job.attempt)
        if failure is not None:
            raise RuntimeError(failure)
        done = steps.done_hosts(job.step, job.attempt, job.hosts, done)
        missing = [h for h in job.hosts if h not in done]
        if not missing:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"hosts {missing} did not report their part of step {job.step} done within "
                f"{commit_timeout:.0f} s"
            )
        with job.lock:  # this host's own progress wakes it at once; others' is polled
            job.changed.wait(delay)
        delay = min(delay * 2, AWAIT_HOSTS_POLL_SECONDS)


def retain(steps: StepDirs, options: Any, latest: int, attempt: str, active: set[int]) -> None:
    """Deletes committed steps beyond the policy, uncommitted debris of crashed saves (not the
    `active` steps still being saved), and the other attempts at step `latest` (committed by
    `attempt`)."""
    all_steps = steps.all()
    committed = steps.committed(all_steps)
    keep = set(committed)
    if options.max_to_keep is not None:
        keep = set(committed[-options.max_to_keep :])
        if options.keep_period:
            keep |= {s for s in committed if s % options.keep_period == 0}
    steps.clear_other_attempts(latest, attempt)
    for s in committed:
        if s not in keep and s != latest:
            steps.delete(s)
    for s in all_steps:
        if s not in active and s not in committed:
            if steps.is_abandoned(s, options.stale_seconds, latest):
                steps.remove_debris(s)
