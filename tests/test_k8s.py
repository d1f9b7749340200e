"""Kubernetes manifests (colocar/k8s, k8s/): schemas and the host pod (sidecar flags, arena
volume, native sidecar, probes, topologies).

No cluster and no network: core objects validate with kubernetes-validate's bundled 1.33
schemas, JobSets with the JobSet CRD's openAPIV3Schema from the copy in tests/data/schemas.
"""

from __future__ import annotations

import base64
import os
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
from k8s_helpers import (
    ALL,
    K8S_VERSION,
    containers_of,
    load_jobset_schema,
    of_kind,
    pod_templates,
    render_case,
    unknown_fields,
)

from colocar.k8s import TOPOLOGIES
from colocar.k8s.options import parse_size
from colocar.k8s.pod import HEALTH_SERVICE, SIDECAR, TRAINER, UID
from colocar.sidecar.server import SERVICE_NAME, build_parser

# --- schemas ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def jobset_schema() -> dict[str, Any]:
    return load_jobset_schema()


@pytest.mark.parametrize("topology,variant,extra", ALL)
def test_core_objects_validate_strict(topology: str, variant: str, extra: tuple[str, ...]) -> None:
    objects = render_case(topology, variant, *extra)
    assert [o["kind"] for o in objects] == ["ServiceAccount", "Service", "NetworkPolicy", "JobSet"]
    core = [o for o in objects if o["kind"] != "JobSet"]
    (jobset,) = of_kind(objects, "JobSet")
    for name, template in pod_templates(jobset).items():
        meta = {"name": f"{jobset['metadata']['name']}-{name}-0-0", **template["metadata"]}
        core.append({"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": template["spec"]})
    # The Secret the printed command creates (value made up here): its name must be valid too.
    secret_name = jobset["metadata"]["name"] + "-colocar-token"
    data = {"token": base64.b64encode(os.urandom(8)).decode()}
    core.append({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": secret_name}, "data": data})
    for obj in core:
        assert kubernetes_validate.validate(obj, K8S_VERSION, strict=True) == K8S_VERSION


def test_strict_validation_rejects_unknown_fields() -> None:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "x"},
        "spec": {"containers": [], "bogus": 1},
    }
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pod, K8S_VERSION, strict=True)


@pytest.mark.parametrize("topology,variant,extra", ALL)
def test_jobset_validates_against_crd(
    jobset_schema: dict[str, Any], topology: str, variant: str, extra: tuple[str, ...]
) -> None:
    (jobset,) = of_kind(render_case(topology, variant, *extra), "JobSet")
    jsonschema.validators.validator_for(jobset_schema)(jobset_schema).validate(jobset)
    assert unknown_fields(jobset, jobset_schema) == []


def test_crd_checks_catch_mistakes(jobset_schema: dict[str, Any]) -> None:
    (jobset,) = of_kind(render_case("v5e-16", "multi-controller"), "JobSet")
    job_spec = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
    job_spec["parallelism"] = "4"
    with pytest.raises(jsonschema.ValidationError, match="is not of type 'integer'"):
        jsonschema.validate(jobset, jobset_schema)
    job_spec["parallelism"] = 4
    job_spec["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    assert unknown_fields(jobset, jobset_schema) == [
        ".spec.replicatedJobs[0].template.spec.template.spec.containers[0].imagePullPolicyy"
    ]


# --- the host pod: sidecar flags, arena volume, native sidecar, probes --------------------------


@pytest.mark.parametrize("topology,variant,extra", ALL)
def test_sidecar_flags_parse_and_arena_fits(topology: str, variant: str, extra: tuple[str, ...]) -> None:
    (jobset,) = of_kind(render_case(topology, variant, *extra), "JobSet")
    spec = pod_templates(jobset)["workers"]["spec"]
    sidecar = containers_of(spec)[SIDECAR]
    assert sidecar["command"] == ["colocar", "sidecar"]
    args = build_parser().parse_args(sidecar["args"])
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in sidecar["volumeMounts"]}
    shm = volumes[mounts[args.shm_dir]]["emptyDir"]
    assert shm["medium"] == "Memory"
    limit = parse_size(shm["sizeLimit"], "sizeLimit")
    reserved = sum(size for _, size in args.pool)
    assert reserved < args.arena_size < limit  # the arena leaves headroom in its volume
    assert args.arena_size >= limit * 7 // 8
    # tmpfs pages count against the sidecar, which pre-faults the arena: memory covers the volume.
    memory = parse_size(sidecar["resources"]["limits"]["memory"], "memory")
    assert sidecar["resources"]["requests"]["memory"] == sidecar["resources"]["limits"]["memory"]
    assert memory > limit
    assert int(sidecar["resources"]["requests"]["cpu"]) >= args.processes >= 1
    # Non-loopback bind: the sidecar insists on a token (and gets one, from a 0600 copy).
    assert args.address.startswith("0.0.0.0:") and args.token_file
    port = int(args.address.rsplit(":", 1)[1])
    assert sidecar["ports"][0]["containerPort"] == port
    # Pod termination: the trainer goes first, then the sidecar drains within what is left.
    assert spec["terminationGracePeriodSeconds"] >= args.drain_seconds + 30
    if "--tls-secret" in extra:
        assert args.tls_cert and args.tls_key and args.tls_client_ca
        assert sidecar["readinessProbe"]["tcpSocket"]["port"] == port  # kubelet's gRPC probe has no TLS
    else:
        assert args.tls_cert is None
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert sidecar[probe]["grpc"] == {"port": port, "service": SERVICE_NAME}


def test_health_service_name_matches_the_sidecar() -> None:
    assert HEALTH_SERVICE == SERVICE_NAME


@pytest.mark.parametrize("topology,variant,extra", ALL)
def test_native_sidecar_shares_the_arena_with_the_trainer(
    topology: str, variant: str, extra: tuple[str, ...]
) -> None:
    (jobset,) = of_kind(render_case(topology, variant, *extra), "JobSet")
    spec = pod_templates(jobset)["workers"]["spec"]
    init = spec["initContainers"]
    assert [c["name"] for c in init] == ["colocar-token", SIDECAR]  # token copied before the sidecar
    assert init[1]["restartPolicy"] == "Always" and "restartPolicy" not in init[0]
    assert SIDECAR not in [c["name"] for c in spec["containers"]]
    sidecar, trainer = init[1], spec["containers"][0]
    assert trainer["name"] == TRAINER
    shm_dir = build_parser().parse_args(sidecar["args"]).shm_dir
    shared = {m["name"]: m["mountPath"] for m in sidecar["volumeMounts"]}
    theirs = {m["name"]: m["mountPath"] for m in trainer["volumeMounts"]}
    (name,) = [n for n, p in shared.items() if p == shm_dir]
    assert theirs[name] == shm_dir  # same volume, same path: the arena path means the same file
    # The sidecar never takes the accelerator; the trainer holds all chips of its host.
    topo = TOPOLOGIES[topology]
    assert topo.resource not in str(sidecar["resources"])
    assert trainer["resources"]["limits"] == {topo.resource: str(topo.chips_per_host)}
    assert sidecar["securityContext"]["runAsUser"] == UID and sidecar["securityContext"]["runAsNonRoot"]
    assert spec["securityContext"]["fsGroup"] == UID


@pytest.mark.parametrize("topology", list(TOPOLOGIES))
def test_topology_placement(topology: str) -> None:
    (jobset,) = of_kind(render_case(topology, "multi-controller"), "JobSet")
    topo = TOPOLOGIES[topology]
    (workers,) = jobset["spec"]["replicatedJobs"]
    job = workers["template"]["spec"]
    assert job["parallelism"] == job["completions"] == topo.hosts
    assert job["completionMode"] == "Indexed" and job["backoffLimit"] == 0
    spec = job["template"]["spec"]
    assert spec["nodeSelector"] == topo.node_selector
    assert {"key": topo.resource, "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    assert jobset["spec"]["network"]["enableDNSHostnames"] is True


def test_topology_table() -> None:
    """The GKE facts for the documented topologies (labels, resource names, hosts x chips)."""
    expected = {
        "v5e-16": ("tpu-v5-lite-podslice", "4x4", 4, 4),
        "v6e-64": ("tpu-v6e-slice", "8x8", 16, 4),
        "v5p-8": ("tpu-v5p-slice", "2x2x1", 1, 4),
    }
    for name, (accelerator, shape, hosts, chips) in expected.items():
        t = TOPOLOGIES[name]
        assert t.node_selector == {
            "cloud.google.com/gke-tpu-accelerator": accelerator,
            "cloud.google.com/gke-tpu-topology": shape,
        }
        assert (t.resource, t.hosts, t.chips_per_host) == ("google.com/tpu", hosts, chips)
    for name, hosts in (("a3-8", 1), ("a3-16", 2)):
        t = TOPOLOGIES[name]
        assert t.node_selector == {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}
        assert (t.resource, t.hosts, t.chips_per_host, t.chips) == ("nvidia.com/gpu", hosts, 8, 8 * hosts)
