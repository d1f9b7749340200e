"""Imports colocar modules and prints which heavy modules they pulled in, or asserts none.

Run by test_shm.py (`colocar.shm`: prints the list), test_loader_config_errors.py
(`colocar.loaders.config`) and test_sidecar_imports.py (the sidecar-side modules); argv:
"print" or "assert", then the modules. "assert" imports them in order and names the first that
pulled in JAX or prometheus_client (loaded by a sidecar only with --metrics-port).
"""

import importlib
import sys

mode, modules = sys.argv[1], sys.argv[2:]
for module in modules:
    importlib.import_module(module)
    if mode == "assert":
        for heavy in ("jax", "prometheus_client"):
            assert heavy not in sys.modules, f"importing {module} imported {heavy}"
if mode == "print":
    print(sorted(m for m in ("jax", "grpc", "jaxlib") if m in sys.modules))
