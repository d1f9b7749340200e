"""The ckpt benchmark's memory meter: a sampler process and the training process's side of it.

The sampler (`sampler_main`) runs in a process of its own, not a thread, so that it never takes
the training thread's GIL; it is niced so that it takes no CPU from either system's writers.
Every `SAMPLE_SECONDS` it records the summed PSS of the training process and all its
descendants, plus the allocated bytes of this process tree's shared-memory files that no process
maps (mapped pages are in the PSS already). `Memory` starts it and reads its samples by window.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

from colocar.bench import child_env

SAMPLE_SECONDS = 0.02


def shm_dirs() -> list[str]:
    """The folders shared-memory files can live in: /dev/shm and $COLOCAR_SHM_DIR."""
    dirs = {"/dev/shm", os.environ.get("COLOCAR_SHM_DIR", "")}
    return sorted(os.path.realpath(d) for d in dirs if d and os.path.isdir(d))


def _mapped_shm(procs: list[Any], dirs: tuple[str, ...]) -> set[str]:
    """The files under `dirs` that one of `procs` maps (from /proc/PID/maps)."""
    mapped: set[str] = set()
    for p in procs:
        try:
            with open(f"/proc/{p.pid}/maps") as f:
                for line in f:  # an anonymous mapping has no 6th field (a path)
                    fields = line.split(maxsplit=5)
                    path = fields[5].strip() if len(fields) == 6 else ""
                    if path.startswith(dirs):
                        mapped.add(path.removesuffix(" (deleted)"))
        except OSError:
            pass
    return mapped


def _named_shm(procs: list[Any], dirs: tuple[str, ...]) -> set[str]:
    """The files under `dirs` whose name holds the pid of one of `procs` (`-PID-`)."""
    pids = {f"-{p.pid}-" for p in procs}
    named: set[str] = set()
    for d in dirs:
        try:
            named |= {d + name for name in os.listdir(d) if any(s in name for s in pids)}
        except OSError:
            pass
    return named


def _allocated(paths: set[str]) -> int:
    """The bytes the filesystem allocated to `paths` (those that still exist)."""
    total = 0
    for path in paths:
        try:
            total += os.stat(path).st_blocks * 512
        except OSError:
            pass
    return total


def _pss(procs: list[Any]) -> int:
    """The summed PSS of `procs` (those still alive and readable)."""
    import psutil

    pss = 0
    for p in procs:
        try:
            pss += p.memory_full_info().pss
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return pss


class _Sampler:
    """The sampler process's state: the tree under `root_pid` (less this process), the
    shared-memory files seen as the tree's, and the samples taken since the last dump."""

    def __init__(self, root_pid: int, interval: float):
        import psutil

        self.root, self.interval, self.me = psutil.Process(root_pid), interval, os.getpid()
        self.dirs = tuple(d + "/" for d in shm_dirs())
        self.ours: set[str] = set()  # once seen as the tree's, a file stays the tree's
        self.samples: list[list[float]] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()

    def tree(self) -> list[Any]:
        """The root and its descendants but this process; [] once the root is gone."""
        import psutil

        try:
            return [self.root] + [p for p in self.root.children(recursive=True) if p.pid != self.me]
        except psutil.NoSuchProcess:
            return []

    def unmapped(self, procs: list[Any]) -> int:
        """Allocated bytes of the tree's shared-memory files that none of `procs` maps."""
        mapped = _mapped_shm(procs, self.dirs)
        self.ours |= mapped
        self.ours |= _named_shm(procs, self.dirs)
        return _allocated(self.ours - mapped)

    def loop(self) -> None:
        """Samples every `interval` until stopped or the tree is gone; the process list and
        the shared-memory files are looked at every 5 samples (~100 ms)."""
        procs: list[Any] = []
        unmapped = 0
        listed = float("-inf")
        while not self.stop.wait(self.interval):
            began = time.monotonic()
            if began - listed >= 5 * self.interval:
                listed = began
                procs = self.tree()
                if not procs:
                    self.stop.set()
                    return
                unmapped = self.unmapped(procs)
            pss = _pss(procs)
            with self.lock:
                self.samples.append([began, pss, unmapped])

    def dump(self) -> list[list[float]]:
        """The samples since the last dump."""
        with self.lock:
            out, self.samples[:] = list(self.samples), []
        return out


def sampler_main() -> None:
    """Runs in its own process: samples the memory of the tree under `argv[1]` (excluding
    itself) every `argv[2]` s; each line "dump" on stdin answers the samples since the last dump
    as a JSON list of [monotonic time the sample began, PSS bytes, unmapped shm bytes]; EOF
    ends it. (The time is taken before the reads: niced on busy cores, a sample can take long.)"""
    sampler = _Sampler(int(sys.argv[1]), float(sys.argv[2]))
    os.nice(19)  # the measuring apparatus must not take CPU from either system's writers
    thread = threading.Thread(target=sampler.loop, daemon=True)
    thread.start()
    for line in sys.stdin:
        if line.strip() == "dump":
            sys.stdout.write(json.dumps(sampler.dump()) + "\n")
            sys.stdout.flush()
    sampler.stop.set()
    thread.join(timeout=2)


class Memory:
    """The training process's side of the sampler: samples by time window."""

    def __init__(self) -> None:
        self._proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "from colocar.bench.ckpt.memory import sampler_main; sampler_main()",
                str(os.getpid()),
                str(SAMPLE_SECONDS),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=child_env(),
        )
        self._samples: list[list[float]] = []

    def _pull(self) -> None:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write("dump\n")
        self._proc.stdin.flush()
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError("the memory sampler died")
        self._samples += json.loads(line)

    def baseline(self, seconds: float = 0.4) -> float:
        """Median of the total over the next `seconds` (nothing else happening), after giving
        the training process's freed heap back to the OS (else a system could reuse what an
        earlier phase freed, and look cheaper than it is)."""
        gc.collect()
        try:
            ctypes.CDLL(None).malloc_trim(0)
        except (OSError, AttributeError):  # not glibc
            pass
        start = time.monotonic()
        time.sleep(seconds)
        return statistics.median(self.window(start, time.monotonic(), all_=True))

    def window(self, t0: float, t1: float, all_: bool = False) -> Any:
        """The samples' totals between `t0` and `t1` (their peak unless `all_`).

        The sampler is niced, so on busy cores it can lag a whole window behind: this waits
        for its first sample begun after `t1`, which stands in for the window if none began
        inside it (a lower bound of the peak, never the 0 of an empty list)."""
        end = t1 + SAMPLE_SECONDS
        deadline = time.monotonic() + 60.0
        self._pull()
        while not self._samples or self._samples[-1][0] <= end:
            if time.monotonic() > deadline:
                raise RuntimeError("the memory sampler took no sample for 60 s")
            time.sleep(2 * SAMPLE_SECONDS)
            self._pull()
        totals = [pss + shm for t, pss, shm in self._samples if t0 <= t <= end]
        if not totals:
            totals = [next(pss + shm for t, pss, shm in self._samples if t > end)]
        self._samples = [s for s in self._samples if s[0] > end]
        return totals if all_ else max(totals)

    def close(self) -> None:
        """Ends the sampler (EOF on its stdin; killed if it does not end within 10 s)."""
        try:
            if self._proc.stdin is not None:
                self._proc.stdin.close()
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=10)
