"""A shared, long-running pool of sidecars that several tenants and jobs use, isolated, with quotas.

The pool's agent (`agent.py`, its process `agent_main.py`) reads the tenants file
(`tenants.py`), admits tenants through a queue (`admission.py`) and runs each admitted
tenant's own sidecars (`tenant_sidecars.py`); controllers join through `client.py`
(`colocar.connect(pool=...)`), operators through `cli.py` (`colocar pool ...`).
"""
