"""A save as the controller runs it: plan, copy, hand over, follow to the commit.

`plan.py` (the blocking part: the step's plan and the device -> arena copies),
`from_blocks.py` (saves written from blocks already in the arenas: a host-memory snapshot),
`topology.py` (who does what in a save, one controller or one JAX process per host, as a
strategy), `writers.py` (the long-lived writer object of each host, kept across saves) and
`inflight.py` (saves started and not ended, followed until they commit or fail).
"""
