"""The sidecar: a process next to the device owner that runs shipped Python code.

Start one with `python -m colocar.sidecar` (or `colocar sidecar`); see `server.py` for flags.
Nothing is imported here so that `python -m colocar.sidecar` stays fast.
"""
