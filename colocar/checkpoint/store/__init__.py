"""Where checkpoints live and what a root holds (controller, sidecar writer, `colocar ckpt`; no JAX).

`storage.py` (a local directory or a GCS prefix: tensorstore specs for the arrays, the small
objects around them), `steps.py` (the step directories of a root and what their markers say),
`catalog.py` (which layout a step is in, colocar's or Orbax's, and every readable step) and
`lease.py` (the writer lease: one manager writes a root at a time).
"""
