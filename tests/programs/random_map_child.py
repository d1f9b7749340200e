"""Prints, as JSON, what a seeded random_map gives for some record indices in a fresh process.

Run by test_loader_sources.py with colocar_test_user_fns on PYTHONPATH; argv: the indices as
a JSON list.
"""

import json
import sys

import colocar_test_user_fns as fns

from colocar.loaders.records import RecordPipeline
from colocar.loaders.sources import open_source

# Our modules import grain lazily; grain itself imports (but does not initialize) JAX when installed.
assert "jax" not in sys.modules and "grain" not in sys.modules
indices = json.loads(sys.argv[1])
pipe = RecordPipeline(open_source("range", n=200), [("random_map", fns.jitter)], seed=11)
out = {i: [pipe[i]["k"], pipe[i]["noise"].tolist()] for i in indices}
print(json.dumps(out))
