"""`colocar k8s render --pool`: the objects of a shared sidecar pool that outlives jobs.

`options.py` takes the inputs and checks them before anything is rendered (`PoolOptions`, the
tenants file validated with the pool's own parser and re-written to mount its tokens from
Secrets); `pods.py` makes the pool's pods: the node daemons (a StatefulSet) and the agent (a
Deployment); `render.py` renders all the pool's objects (`render_pool`: Secrets, the tenants
ConfigMap, the pods, Services, NetworkPolicies) and what a job's pod adds to join it
(`join_snippet`).
"""
