"""Imports a colocar module and prints which heavy modules it pulled in, or asserts none.

Run by test_shm.py (`colocar.shm`: prints the list) and test_loader_config_errors.py
(`colocar.loaders.config`: asserts that JAX stays out); argv: the module, "print" or "assert".
"""

import importlib
import sys

module, mode = sys.argv[1:3]
importlib.import_module(module)
if mode == "print":
    print(sorted(m for m in ("jax", "grpc", "jaxlib") if m in sys.modules))
else:
    assert "jax" not in sys.modules, "jax imported"
