"""What the elastic manager decides from (runs in the controller).

`survivors.py` (which hosts are alive, `ClusterView` over them, `ElasticError`), `tiers.py` (the
places a state comes back from: snapshots in host memory, checkpoints in storage), `data.py`
(the data position in records), `rejoin.py` (lost hosts that came back rejoin at a step
boundary) and `events.py` (what the manager did, with timings).
"""
