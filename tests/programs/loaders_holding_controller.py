"""A training process that holds two batches (two slots lent to it over its feed), says where
its pipeline's workers are, and waits to be killed.

Run by test_loaders_failures.py; argv: its sidecar's address, the token file, and optionally
"raise": then it prints the same line and ends in an uncaught error instead, from a function
whose frame holds the open iterator (as a training loop's bug leaves it: the traceback keeps the
frame until the interpreter's shutdown).
"""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import colocar  # noqa: E402
from colocar import loaders  # noqa: E402

cluster = colocar.connect([sys.argv[1]], token_file=sys.argv[2], lease_seconds=2)
config = {
    "source": {"kind": "range", "n": 1000},
    "global_batch_size": 16,
    "num_epochs": None,
    "prefetch": 3,
    "workers_per_host": 1,
}


def train() -> None:
    it = loaders.load(config, cluster)
    held = [next(it), next(it)]  # noqa: F841 - held
    assert it._fed, "the batches should come over a feed"
    print(*it._remote[0].worker_pids.submit().result(), flush=True)  # a link thread now idles
    if sys.argv[3:] == ["raise"]:
        raise RuntimeError("a bug in the training loop")
    sys.stdin.readline()


train()
