"""The sidecar side of the snapshot store: keepers, the slices cut from their blocks, peer transfer.

`keeper.py` (`SnapshotKeeper`: a detached object per host holding snapshot blocks), `multi.py`
(`MultiKeeper`: the keeper of a multi-controller job), `stitch.py` (slices cut from the blocks
over them) and `peers.py` (sidecar-to-sidecar bulk transfer of replicas). These run in the
sidecar and import no JAX.
"""
