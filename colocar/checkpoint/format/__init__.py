"""The on-storage format of colocar's own layout (controller, sidecar writer, `colocar ckpt`).

`layout.py` (object names, marker contents, chunk shapes, tensorstore specs; no JAX),
`keypaths.py` (an array leaf's directory from its `jax.tree_util` key path) and `tree.py`
(pytrees to manifest entries and back, and `abstract`, a restore target from a state).
Orbax's layout is `checkpoint/orbax/`.
"""
