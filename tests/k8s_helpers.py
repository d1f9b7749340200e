"""What the Kubernetes manifest tests share: the rendered cases (every topology and variant,
plus one with the options the examples do not use) and ways to pick objects out of them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

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
