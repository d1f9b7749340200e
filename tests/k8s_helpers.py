"""What the Kubernetes manifest tests share: the rendered cases (every topology and variant,
plus one with the options the examples do not use) and ways to pick objects out of them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from colocar.k8s import TOPOLOGIES, build_options, render
from colocar.k8s.cli import EXAMPLE_ARGS, render_text
from colocar.k8s.options import VARIANTS

REPO = Path(__file__).resolve().parent.parent
K8S = REPO / "k8s"
K8S_VERSION = "1.33"
CRD_NAME = "jobset.x-k8s.io_jobsets.yaml"
IMAGE = "us-docker.pkg.dev/p/colocar/train:0.1.0"
BUCKET = "gs://my-bucket/runs/1"

CASES = [(t, v) for t in TOPOLOGIES for v in VARIANTS]
# Options the examples do not exercise: TLS, pools, own sizes and images, another port.
EXTRA = [
    "--tls-secret", "colocar-tls", "--pool", "ckpt=8Gi", "--pool", "ring=1536Mi", "--shm-size", "48Gi",
    "--sidecar-cpu", "3", "--sidecar-memory", "6Gi", "--port", "50051", "--name", "llama-70b",
    "--trainer-image", "gcr.io/p/trainer@sha256:" + "a" * 64,
    "--trainer-command", "python -m my.train --steps 10",
]  # fmt: skip


def render_case(topology: str, variant: str, *extra: str) -> list[dict[str, Any]]:
    """The objects rendered for a case: through the API, or through the command line with `extra`."""
    if not extra:
        return render(build_options(topology=topology, variant=variant, image=IMAGE, bucket=BUCKET))
    text, _ = render_text(["--topology", topology, "--variant", variant, *EXAMPLE_ARGS, *extra])
    return list(yaml.safe_load_all(text))


ALL = [pytest.param(t, v, (), id=f"{t}-{v}") for t, v in CASES] + [
    pytest.param("v5e-16", v, tuple(EXTRA), id=f"v5e-16-{v}-tls-pools") for v in VARIANTS
]


def of_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    """The objects of one kind."""
    return [o for o in objects if o["kind"] == kind]


def pod_templates(jobset: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A JobSet's pod templates by replicated job name."""
    return {rj["name"]: rj["template"]["spec"]["template"] for rj in jobset["spec"]["replicatedJobs"]}


def containers_of(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A pod spec's init and regular containers by name."""
    return {c["name"]: c for c in spec.get("initContainers", []) + spec["containers"]}


def env_of(container: dict[str, Any]) -> dict[str, str]:
    """A container's environment; a token never comes from a `valueFrom`."""
    assert all("valueFrom" not in e for e in container["env"] if "TOKEN" in e["name"])
    return {e["name"]: e["value"] for e in container["env"]}


def load_jobset_schema() -> dict[str, Any]:
    """The JobSet CRD's v1alpha2 openAPIV3Schema (a copy in tests/data/schemas, see its README)."""
    with open(REPO / "tests" / "data" / "schemas" / CRD_NAME) as f:
        crd = yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha2"]
    return version["schema"]["openAPIV3Schema"]


def unknown_fields(value: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """Fields the API server would prune: keys a structural schema does not declare."""
    found: list[str] = []
    if isinstance(value, dict):
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            if props is not None and key in props:
                found += unknown_fields(item, props[key], f"{path}.{key}")
            elif isinstance(extra, dict):
                found += unknown_fields(item, extra, f"{path}.{key}")
            elif props is not None and not schema.get("x-kubernetes-preserve-unknown-fields"):
                found.append(f"{path}.{key}")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            found += unknown_fields(item, schema["items"], f"{path}[{i}]")
    return found


def validate_manifests(objects: list[dict[str, Any]], jobset_schema: dict[str, Any]) -> None:
    """Rendered objects as an API server would take them: core objects and each JobSet's pod
    templates strictly (kubernetes-validate), JobSets against the CRD, with no unknown field."""
    core = [o for o in objects if o["kind"] != "JobSet"]
    for jobset in of_kind(objects, "JobSet"):
        jsonschema.validators.validator_for(jobset_schema)(jobset_schema).validate(jobset)
        assert unknown_fields(jobset, jobset_schema) == []
        for name, template in pod_templates(jobset).items():
            meta = {"name": f"{jobset['metadata']['name']}-{name}-0-0", **template["metadata"]}
            core.append({"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": template["spec"]})
    for obj in core:
        assert kubernetes_validate.validate(obj, K8S_VERSION, strict=True) == K8S_VERSION
