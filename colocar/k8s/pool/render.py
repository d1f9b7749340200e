"""`render_pool(options)`: the objects of a shared sidecar pool that outlives jobs.

Objects: a Secret per tenant plus the admin's and the node token's (fresh tokens; left out
with `--no-secrets`, which prints the commands that create them instead), the tenants
ConfigMap, the node pods (StatefulSet, headless Service), the agent (Deployment, Service),
NetworkPolicies that admit only the pool's jobs, and with `--pod-monitoring` a PodMonitoring
of the agent's metrics. `join_snippet` is what a job's pod adds to use the pool.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from typing import Any

from colocar.protocol.tokens import new_token

from ..render import create_secret_command, monitoring, other_ports, to_yaml
from .options import POOL_SHM_PATH, PoolOptions
from .pods import (
    HOSTNAME,
    admin_secret,
    agent_deployment,
    agent_labels,
    node_labels,
    node_secret,
    node_stateful_set,
    pool_labels,
    shm_host_path,
    tenant_secret,
    tenants_config_map,
)

POOL_LABEL = "colocar.dev/pool"  # on a job's pods: the pool's NetworkPolicies admit them
JOB_TOKEN_DIR = "/etc/colocar/pool-token"


def _meta(opts: PoolOptions, name: str, component: str = "") -> dict[str, Any]:
    return {"name": name, "namespace": opts.namespace, "labels": pool_labels(opts, component)}


def secret_names(opts: PoolOptions) -> list[str]:
    """Every Secret the pool reads, admin's and node's first."""
    return [admin_secret(opts), node_secret(opts), *(tenant_secret(opts, t) for t in opts.tenants)]


def _secret(opts: PoolOptions, name: str, token: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(opts, name),
        "type": "Opaque",
        "data": {"token": base64.b64encode(token.encode()).decode()},
    }


def config_map(opts: PoolOptions) -> dict[str, Any]:
    """The tenants file; its token_file entries name the Secrets' mounts in the agent."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(opts, tenants_config_map(opts)),
        "data": {"tenants.yaml": opts.tenants_yaml},
    }


def _service(opts: PoolOptions, name: str, pods: dict[str, str], headless: bool) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "selector": pods,
        "ports": [{"name": "colocar", "port": opts.port, "targetPort": opts.port, "protocol": "TCP"}],
    }
    if headless:  # node i is <nodes>-<i>.<nodes>, published before it is ready
        spec = {"clusterIP": "None", "publishNotReadyAddresses": True, **spec}
    else:
        spec = {"type": "ClusterIP", **spec}
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(opts, name), "spec": spec}


def _jobs(opts: PoolOptions) -> dict[str, Any]:
    return {"podSelector": {"matchLabels": {POOL_LABEL: opts.name}}}


def network_policies(opts: PoolOptions) -> list[dict[str, Any]]:
    """The agent's port admits only the pool's jobs (other ports, its metrics, stay open); the
    node pods admit TCP on every port (the tenants' sidecars listen on ports the node picks)
    from the jobs and the agent only."""
    agent = {"podSelector": {"matchLabels": agent_labels(opts)}}
    agent_rules = [
        {"from": [_jobs(opts)], "ports": [{"protocol": "TCP", "port": opts.port}]},
        {"ports": other_ports(opts.port)},
    ]
    node_rules = [{"from": [_jobs(opts), agent], "ports": [{"protocol": "TCP", "port": 1, "endPort": 65535}]}]
    return [
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": _meta(opts, name),
            "spec": {"podSelector": {"matchLabels": pods}, "policyTypes": ["Ingress"], "ingress": rules},
        }
        for name, pods, rules in (
            (f"{opts.name}-agent", agent_labels(opts), agent_rules),
            (opts.nodes, node_labels(opts), node_rules),
        )
    ]


def render_pool(opts: PoolOptions, token: Callable[[], str] = new_token) -> list[dict[str, Any]]:
    """The objects to apply, in apply order; `token` makes each Secret's value."""
    objects = [_secret(opts, name, token()) for name in secret_names(opts)] if opts.secrets else []
    objects += [
        config_map(opts),
        _service(opts, opts.nodes, node_labels(opts), headless=True),
        _service(opts, opts.name, agent_labels(opts), headless=False),
        *network_policies(opts),
        node_stateful_set(opts, _meta(opts, opts.nodes, "pool-node")),
        agent_deployment(opts, _meta(opts, f"{opts.name}-agent", "pool-agent")),
    ]
    if opts.pod_monitoring:
        objects.append(monitoring(_meta(opts, f"{opts.name}-agent"), agent_labels(opts)))
    return objects


def pool_header(opts: PoolOptions, command: str) -> str:
    """The YAML's leading comment: what it is, how it was made, and what it holds."""
    lines = [
        f"A shared colocar pool on {opts.topology.description}: {opts.hosts} node pod(s), one agent.",
        f"Generated by: colocar k8s render {command}",
    ]
    if opts.secrets:
        lines += [
            "WARNING: this file holds fresh tokens (the Secrets): apply it, do not commit it. Rendering",
            "again makes new ones; to change the pool later without new tokens, use --no-secrets.",
        ]
    else:
        lines.append("No Secrets here: create them first (the commands are printed on stderr).")
    return "\n".join(lines)


def join_snippet(opts: PoolOptions, tenant: str) -> dict[str, Any]:
    """What a job's pod template adds to use the pool as `tenant` (merge it into yours)."""
    shm = {"path": shm_host_path(opts), "type": "Directory"}  # the pool node's: it must exist
    secret = {"secretName": tenant_secret(opts, tenant), "defaultMode": 0o440}
    nodes = {"labelSelector": {"matchLabels": node_labels(opts)}, "topologyKey": HOSTNAME}
    trainer = {
        "name": "trainer",
        "env": [
            {"name": "COLOCAR_TOKEN_FILE", "value": f"{JOB_TOKEN_DIR}/token"},
            {"name": "COLOCAR_NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        ],
        "volumeMounts": [
            {"name": "colocar-pool-shm", "mountPath": POOL_SHM_PATH},
            {"name": "colocar-pool-token", "mountPath": JOB_TOKEN_DIR, "readOnly": True},
        ],
    }
    return {
        "metadata": {"labels": {POOL_LABEL: opts.name}},
        "spec": {
            "affinity": {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [nodes]}},
            "containers": [trainer],
            "volumes": [
                {"name": "colocar-pool-shm", "hostPath": shm},
                {"name": "colocar-pool-token", "secret": secret},
            ],
        },
    }


def connect_line(opts: PoolOptions) -> str:
    """The job's side: the agent's Service; the tenant's token from COLOCAR_TOKEN_FILE."""
    return f'colocar.connect(pool="{opts.agent_address}")'


def pool_commands(opts: PoolOptions) -> list[str]:
    """What `render --pool` prints on stderr: the Secrets (with --no-secrets), how tenants and
    the admin get their tokens, and how a job joins."""
    ns = opts.namespace
    lines = []
    if not opts.secrets:
        lines.append("# Before `kubectl apply`: the Secrets, once (each holds a fresh token):")
        lines += [create_secret_command(name, ns) for name in secret_names(opts)]
    lines.append("# A tenant's token (for a job outside the cluster, or to check it):")
    lines += [
        f"kubectl get secret {tenant_secret(opts, t)} -n {ns} -o jsonpath='{{.data.token}}' | base64 -d"
        for t in opts.tenants
    ]
    lines += [
        "# The admin: every tenant's use and the queue, through a port-forward:",
        f"kubectl get secret {admin_secret(opts)} -n {ns} -o jsonpath='{{.data.token}}' | base64 -d "
        "> admin.token && chmod 600 admin.token",
        f"kubectl port-forward -n {ns} svc/{opts.name} {opts.port} &",
        f"colocar pool status --pool 127.0.0.1:{opts.port} --token-file admin.token",
        f"# A job joins (in namespace {ns}) as one tenant: its pods carry the label",
        f"# {POOL_LABEL}: {opts.name} (the NetworkPolicies admit them), land on a pool node (podAffinity),",
        f"# mount the node's arena folder at {POOL_SHM_PATH} and the tenant's Secret, and connect with",
        f"#   {connect_line(opts)}",
        f"# For tenant {opts.tenants[0]}, merge this into the job's pod template (the container: yours):",
        to_yaml([join_snippet(opts, opts.tenants[0])]).rstrip(),
    ]
    return lines
