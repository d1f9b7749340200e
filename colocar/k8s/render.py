"""`render(options)`: the objects of one job, as plain dicts, and their YAML.

Objects: a ServiceAccount (Workload Identity, no keys), the headless Service that names the
pods, a NetworkPolicy that admits only the job's own pods to the sidecar port, and the JobSet;
with `--pod-monitoring`, a PodMonitoring that has GKE's managed Prometheus scrape the sidecars.
The token Secret is only referenced, never rendered: `secret_command` prints how to create it.
"""

from __future__ import annotations

from typing import Any

import yaml

from .options import DEFAULT_GSA, RenderOptions
from .pod import (
    METRICS_PATH,
    METRICS_PORT_NAME,
    controller_pod_template,
    host_pod_template,
    service_account,
    token_secret,
)

JOBSET_API = "jobset.x-k8s.io/v1alpha2"
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"  # set by JobSet on every pod it creates
EXCLUSIVE = "alpha.jobset.sigs.k8s.io/exclusive-topology"
POD_MONITORING_API = "monitoring.googleapis.com/v1"
SCRAPE_INTERVAL = "30s"


def _labels(opts: RenderOptions) -> dict[str, str]:
    return {"app.kubernetes.io/name": "colocar", "app.kubernetes.io/instance": opts.name}


def _meta(opts: RenderOptions, name: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "labels": _labels(opts), **extra}


def service_account_object(opts: RenderOptions) -> dict[str, Any]:
    """GCS through Workload Identity: the pods act as the Google service account."""
    annotations = {"iam.gke.io/gcp-service-account": opts.gcp_service_account}
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": _meta(opts, service_account(opts), annotations=annotations),
        "automountServiceAccountToken": False,
    }


def headless_service(opts: RenderOptions) -> dict[str, Any]:
    """The JobSet's subdomain: `<name>-workers-0-<i>.<name>` resolves to host i's pod.

    JobSet creates a Service of this name when none exists; rendering it names the sidecar port
    and publishes pods before they are ready (the JAX coordinator is looked up that early).
    """
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(opts, opts.name),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {JOBSET_NAME_LABEL: opts.name},
            "ports": [{"name": "colocar", "port": opts.port, "targetPort": opts.port, "protocol": "TCP"}],
        },
    }


def other_ports(port: int) -> list[dict[str, Any]]:
    """Every TCP port but `port`, and every UDP port: a rule that leaves them open."""
    others: list[dict[str, Any]] = [{"protocol": "TCP", "port": 1, "endPort": port - 1}]
    if port < 65535:
        others.append({"protocol": "TCP", "port": port + 1, "endPort": 65535})
    others.append({"protocol": "UDP", "port": 1, "endPort": 65535})
    return others


def network_policy(opts: RenderOptions) -> dict[str, Any]:
    """Only the job's own pods reach the sidecar port; other ports stay as they were."""
    job_pods = {"podSelector": {"matchLabels": {JOBSET_NAME_LABEL: opts.name}}}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(opts, f"{opts.name}-colocar-sidecar"),
        "spec": {
            "podSelector": {"matchLabels": {JOBSET_NAME_LABEL: opts.name}},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [job_pods], "ports": [{"protocol": "TCP", "port": opts.port}]},
                {"ports": other_ports(opts.port)},
            ],
        },
    }


def _replicated_job(
    name: str, pods: int, template: dict[str, Any], annotations: dict[str, str], restarts: int = 0
) -> dict[str, Any]:
    """`restarts`: in-place container restarts of each pod (restartPolicy OnFailure), which
    the Job counts against `backoffLimit` over all its pods; none: a lost host fails the slice
    and the JobSet restarts it whole."""
    metadata = {"annotations": annotations} if annotations else {}
    job: dict[str, Any] = {
        "name": name,
        "replicas": 1,
        "template": {
            **({"metadata": metadata} if metadata else {}),
            "spec": {
                "parallelism": pods,
                "completions": pods,
                "completionMode": "Indexed",
                "backoffLimit": restarts * pods,
                "template": template,
            },
        },
    }
    return job


def jobset(opts: RenderOptions) -> dict[str, Any]:
    """One slice of hosts (plus, single-controller, a controller started once they are ready)."""
    topo = opts.topology
    labels = _labels(opts)
    exclusive = {EXCLUSIVE: "cloud.google.com/gke-nodepool"} if topo.exclusive_node_pool else {}
    template = host_pod_template(opts, labels)
    workers = _replicated_job("workers", topo.hosts, template, exclusive, opts.trainer_restarts)
    spec: dict[str, Any] = {
        "network": {"enableDNSHostnames": True, "subdomain": opts.name, "publishNotReadyAddresses": True},
        "failurePolicy": {"maxRestarts": opts.max_restarts},
        "replicatedJobs": [workers],
    }
    if opts.variant == "single-controller":
        controller = _replicated_job("controller", 1, controller_pod_template(opts, labels), {})
        controller["dependsOn"] = [{"name": "workers", "status": "Ready"}]
        spec["replicatedJobs"].append(controller)
        spec["successPolicy"] = {"operator": "All", "targetReplicatedJobs": ["controller"]}
    return {
        "apiVersion": JOBSET_API,
        "kind": "JobSet",
        "metadata": _meta(opts, opts.name, annotations={"colocar.dev/topology": topo.name}),
        "spec": spec,
    }


def pod_monitoring(opts: RenderOptions) -> dict[str, Any]:
    """GKE's managed Prometheus scrapes the sidecar of every host pod (it ignores the
    `prometheus.io/*` annotations, which a self-run Prometheus reads)."""
    hosts = {JOBSET_NAME_LABEL: opts.name, "app.kubernetes.io/component": "host"}
    return monitoring(_meta(opts, f"{opts.name}-colocar-sidecar"), hosts)


def monitoring(metadata: dict[str, Any], pods: dict[str, str]) -> dict[str, Any]:
    """A PodMonitoring that scrapes the `metrics` port of the pods labelled `pods`."""
    endpoint = {"port": METRICS_PORT_NAME, "path": METRICS_PATH, "interval": SCRAPE_INTERVAL}
    return {
        "apiVersion": POD_MONITORING_API,
        "kind": "PodMonitoring",
        "metadata": metadata,
        "spec": {"selector": {"matchLabels": pods}, "endpoints": [endpoint]},
    }


def render(opts: RenderOptions) -> list[dict[str, Any]]:
    """The objects to apply, in apply order."""
    objects = [service_account_object(opts), headless_service(opts), network_policy(opts), jobset(opts)]
    if opts.pod_monitoring:
        objects.append(pod_monitoring(opts))
    return objects


class _Dumper(yaml.SafeDumper):
    """Writes every value out in full: no `&anchor`/`*alias` for dicts used twice; a text of
    several lines (a file in a ConfigMap) as a `|` block, as it reads."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _text(dumper: yaml.SafeDumper, data: str) -> yaml.Node:
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style="|" if "\n" in data else None)


_Dumper.add_representer(str, _text)


def to_yaml(objects: list[dict[str, Any]], header: str = "") -> str:
    """Multi-document YAML; `header` becomes leading comment lines."""
    comment = "".join(f"# {line}\n" for line in header.splitlines())
    body = yaml.dump_all(
        objects, Dumper=_Dumper, sort_keys=False, default_flow_style=False, explicit_start=True, width=100
    )
    return comment + body


def secret_command(opts: RenderOptions) -> str:
    """The one command that creates the token Secret (run once; the value never enters a file)."""
    return create_secret_command(token_secret(opts), opts.namespace)


def create_secret_command(name: str, namespace: str) -> str:
    """`kubectl create secret` of a Secret `name` holding a fresh token under the key `token`."""
    return (
        f"kubectl create secret generic {name} -n {namespace} "
        "--from-literal=token=\"$(python3 -c 'import secrets; print(secrets.token_hex(32))')\""
    )


def setup_commands(opts: RenderOptions) -> list[str]:
    """Commands to run before `kubectl apply`: the Secret and the Workload Identity bindings."""
    gsa, bucket = opts.gcp_service_account, opts.bucket_name
    project = gsa.split("@", 1)[1].removesuffix(".iam.gserviceaccount.com")
    lines = [
        "# Before `kubectl apply`: the token Secret, once per job name and namespace:",
        secret_command(opts),
        "# Workload Identity: the pods act as the Google service account, which may use the bucket:",
        f"gcloud iam service-accounts add-iam-policy-binding {gsa} --role roles/iam.workloadIdentityUser "
        f'--member "serviceAccount:{project}.svc.id.goog[{opts.namespace}/{service_account(opts)}]"',
        f"gcloud storage buckets add-iam-policy-binding gs://{bucket} --member serviceAccount:{gsa} "
        "--role roles/storage.objectUser",
    ]
    if gsa == DEFAULT_GSA:
        lines.append("# warning: --gcp-service-account not given; replace PROJECT_ID in the manifests")
    return lines
