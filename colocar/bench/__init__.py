"""colocar benchmarks: each has `run(quick, repeats) -> dict`; see `colocar.bench.run`.

A benchmark is a module (`rpc.py`), or a subpackage when it has parts (`ckpt/`, `recovery/`,
`firstbatch/`: `benchmark.py` holds `run`, the package's docstring what it measures).

They ship inside the package, so `colocar bench NAME` works wherever colocar is installed;
the figures and how they were measured are in `benchmarks/RESULTS.md` of the repository.
"""

from __future__ import annotations

import os


def child_env() -> dict[str, str]:
    """The environment for a helper process of a benchmark: this process's, with the folder
    that holds the `colocar` package first on PYTHONPATH, so the child imports the same copy."""
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path}


def request_cpu_devices(count: int) -> str:
    """Asks XLA for `count` CPU devices (unless XLA_FLAGS already names a count) and returns
    the flag, for error messages. Takes effect only if it runs before JAX starts its backends:
    the benchmarks that need several devices call it as they are imported."""
    flag = f"--xla_force_host_platform_device_count={count}"
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
    return flag
