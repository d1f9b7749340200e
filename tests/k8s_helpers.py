"""What the Kubernetes manifest tests share: the rendered cases (every topology and variant,
plus one with the options the examples do not use) and ways to pick objects out of them.
"""

from __future__ import annotations

import base64
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from colocar.k8s import TOPOLOGIES, build_options, render
from colocar.k8s.cli import EXAMPLE_ARGS, main, render_pool_text, render_text
from colocar.k8s.options import VARIANTS
from colocar.k8s.pool.options import PoolOptions

REPO = Path(__file__).resolve().parent.parent
K8S = REPO / "k8s"
K8S_VERSION = "1.33"
CRD_NAME = "jobset.x-k8s.io_jobsets.yaml"
IMAGE = "us-docker.pkg.dev/p/colocar/train:0.1.0"
BUCKET = "gs://my-bucket/runs/1"

CASES = [(t, v) for t in TOPOLOGIES for v in VARIANTS]
# Options the examples do not exercise: TLS, pools, own sizes and images, another port.
EXTRA = [
    "--tls-secret", "colocar-tls", "--arena-pool", "ckpt=8Gi", "--arena-pool", "ring=1536Mi",
    "--shm-size", "48Gi", "--sidecar-cpu", "3", "--sidecar-memory", "6Gi", "--port", "50051",
    "--name", "llama-70b",
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


# --- the shared pool (colocar k8s render --pool) ------------------------------------------------

# A tenants file as for `colocar pool up` (its token_file is replaced), one tenant with defaults.
POOL_TENANTS = """\
tenants:
  alice:
    token_file: alice.token   # replaced by the Secret's mount
    priority: 10
    quotas: {arena: 512M, calls: 4, processes: 0, sessions: 2}
  team-b: {}
"""
BASE = ["--pool", "--image", IMAGE, "--tenants", "tenants.yaml"]
POD_MONITORING_CRD = "monitoring.googleapis.com_podmonitorings.yaml"


def pool_case(
    topology: str, *extra: str, text: str = POOL_TENANTS
) -> tuple[list[dict[str, Any]], PoolOptions]:
    """The objects and options `render --pool` makes of `text` as the tenants file."""
    out, opts = render_pool_text(["--topology", topology, *BASE, *extra], tenants_text=text)
    return list(yaml.safe_load_all(out)), opts


def render_main(argv: list[str], cwd: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """`colocar k8s render ARGV` run in `cwd`: (exit status, stdout, stderr)."""
    here = os.getcwd()
    os.chdir(cwd)
    try:
        main(["render", *argv])
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    finally:
        os.chdir(here)
    out, err = capsys.readouterr()
    return code, out, err


def load_crd_schema(file: str, version: str) -> dict[str, Any]:
    """A CRD's openAPIV3Schema of `version`, from its copy in tests/data/schemas."""
    crd = yaml.safe_load((REPO / "tests" / "data" / "schemas" / file).read_text())
    (found,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    return found["schema"]["openAPIV3Schema"]


def one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    """The one object of `kind`."""
    (found,) = of_kind(objects, kind)
    return found


def pod_spec(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    """The pod spec of the one StatefulSet or Deployment."""
    return one(objects, kind)["spec"]["template"]["spec"]


def mounted(spec: dict[str, Any], container: dict[str, Any], path: str) -> tuple[dict[str, Any], str]:
    """The volume that holds file `path` in `container`, and the file's path inside it."""
    volumes = {v["name"]: v for v in spec["volumes"]}
    for m in container["volumeMounts"]:
        if path.startswith(m["mountPath"].rstrip("/") + "/"):
            return volumes[m["name"]], path[len(m["mountPath"]) + 1 :]
    raise AssertionError(f"{path} is on no volume of {container['name']}")


def secret_of(volume: dict[str, Any], inner: str) -> tuple[str, str]:
    """(Secret name, key) a file `inner` of a secret or projected volume shows."""
    sources = volume["projected"]["sources"] if "projected" in volume else [{"secret": volume["secret"]}]
    for source in sources:
        secret = source["secret"]
        for item in secret["items"]:
            if item["path"] == inner:
                return secret.get("name") or secret["secretName"], item["key"]
    raise AssertionError(f"{inner} is in no Secret of {volume['name']}")


def tokens_of(objects: list[dict[str, Any]]) -> dict[str, str]:
    """Secret name -> the token it holds."""
    return {
        s["metadata"]["name"]: base64.b64decode(s["data"]["token"]).decode()
        for s in of_kind(objects, "Secret")
    }


def header_command_output(example: Path) -> tuple[str, subprocess.CompletedProcess[str]]:
    """An example file's text and what the `colocar k8s render ...` command in its header
    prints when run (end to end: the command a user copies)."""
    text = example.read_text()
    command = re.search(r"^# Generated by: colocar k8s (render .*)$", text, re.MULTILINE)
    assert command is not None, f"{example} has no 'Generated by' line"
    proc = subprocess.run(
        [sys.executable, "-m", "colocar.k8s.cli", *shlex.split(command.group(1))],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return text, proc
