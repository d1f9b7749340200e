"""Kubernetes manifests (colocar/k8s, k8s/): schemas, sidecar flags, security, examples, image.

No cluster and no network: core objects validate with kubernetes-validate's bundled 1.33
schemas, JobSets with the JobSet CRD's openAPIV3Schema from the shared schemas directory.
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
from packaging.specifiers import SpecifierSet

from colocar.k8s import TOPOLOGIES, build_options, render
from colocar.k8s.cli import EXAMPLE_ARGS, example_files, main, render_text
from colocar.k8s.options import VARIANTS, parse_size
from colocar.k8s.pod import HEALTH_SERVICE, SIDECAR, TRAINER, UID
from colocar.sidecar.server import SERVICE_NAME, build_parser

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


def _render(topology: str, variant: str, *extra: str) -> list[dict[str, Any]]:
    if not extra:
        return render(build_options(topology=topology, variant=variant, image=IMAGE, bucket=BUCKET))
    text, _ = render_text(["--topology", topology, "--variant", variant, *EXAMPLE_ARGS, *extra])
    return list(yaml.safe_load_all(text))


ALL = [pytest.param(t, v, (), id=f"{t}-{v}") for t, v in CASES] + [
    pytest.param("v5e-16", v, tuple(EXTRA), id=f"v5e-16-{v}-tls-pools") for v in VARIANTS
]


def _kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def _pod_templates(jobset: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {rj["name"]: rj["template"]["spec"]["template"] for rj in jobset["spec"]["replicatedJobs"]}


def _containers(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in spec.get("initContainers", []) + spec["containers"]}


# --- schemas ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def jobset_schema() -> dict[str, Any]:
    """The JobSet CRD's v1alpha2 openAPIV3Schema (a copy in tests/data/schemas, see its README)."""
    with open(REPO / "tests" / "data" / "schemas" / CRD_NAME) as f:
        crd = yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha2"]
    return version["schema"]["openAPIV3Schema"]


def _unknown_fields(value: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """Fields the API server would prune: keys a structural schema does not declare."""
    found: list[str] = []
    if isinstance(value, dict):
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            if props is not None and key in props:
                found += _unknown_fields(item, props[key], f"{path}.{key}")
            elif isinstance(extra, dict):
                found += _unknown_fields(item, extra, f"{path}.{key}")
            elif props is not None and not schema.get("x-kubernetes-preserve-unknown-fields"):
                found.append(f"{path}.{key}")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            found += _unknown_fields(item, schema["items"], f"{path}[{i}]")
    return found


@pytest.mark.parametrize("topology,variant,extra", ALL)
def test_core_objects_validate_strict(topology: str, variant: str, extra: tuple[str, ...]) -> None:
    objects = _render(topology, variant, *extra)
    assert [o["kind"] for o in objects] == ["ServiceAccount", "Service", "NetworkPolicy", "JobSet"]
    core = [o for o in objects if o["kind"] != "JobSet"]
    (jobset,) = _kind(objects, "JobSet")
    for name, template in _pod_templates(jobset).items():
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
    (jobset,) = _kind(_render(topology, variant, *extra), "JobSet")
    jsonschema.validators.validator_for(jobset_schema)(jobset_schema).validate(jobset)
    assert _unknown_fields(jobset, jobset_schema) == []


def test_crd_checks_catch_mistakes(jobset_schema: dict[str, Any]) -> None:
    (jobset,) = _kind(_render("v5e-16", "multi-controller"), "JobSet")
    job_spec = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
    job_spec["parallelism"] = "4"
    with pytest.raises(jsonschema.ValidationError, match="is not of type 'integer'"):
        jsonschema.validate(jobset, jobset_schema)
    job_spec["parallelism"] = 4
    job_spec["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    assert _unknown_fields(jobset, jobset_schema) == [
        ".spec.replicatedJobs[0].template.spec.template.spec.containers[0].imagePullPolicyy"
    ]


# --- the host pod: sidecar flags, arena volume, native sidecar, probes --------------------------


@pytest.mark.parametrize("topology,variant,extra", ALL)
def test_sidecar_flags_parse_and_arena_fits(topology: str, variant: str, extra: tuple[str, ...]) -> None:
    (jobset,) = _kind(_render(topology, variant, *extra), "JobSet")
    spec = _pod_templates(jobset)["workers"]["spec"]
    sidecar = _containers(spec)[SIDECAR]
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
    (jobset,) = _kind(_render(topology, variant, *extra), "JobSet")
    spec = _pod_templates(jobset)["workers"]["spec"]
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
    (jobset,) = _kind(_render(topology, "multi-controller"), "JobSet")
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


# --- controllers: what colocar.connect() reads -------------------------------------------------


def _env(container: dict[str, Any]) -> dict[str, str]:
    assert all("valueFrom" not in e for e in container["env"] if "TOKEN" in e["name"])
    return {e["name"]: e["value"] for e in container["env"]}


@pytest.mark.parametrize("topology", list(TOPOLOGIES))
def test_multi_controller_trainer_uses_its_own_sidecar(topology: str) -> None:
    (jobset,) = _kind(_render(topology, "multi-controller"), "JobSet")
    trainer = _containers(_pod_templates(jobset)["workers"]["spec"])[TRAINER]
    env = _env(trainer)
    assert env["COLOCAR_SIDECARS"] == "127.0.0.1:7070"
    assert "COLOCAR_TOKEN" not in env  # the value stays in the Secret
    assert env["COLOCAR_BUCKET"] == BUCKET
    if TOPOLOGIES[topology].jax_coordinator:
        assert env["JAX_COORDINATOR_ADDRESS"] == "train-workers-0-0.train:8476"


@pytest.mark.parametrize("topology", list(TOPOLOGIES))
def test_single_controller_finds_sidecars_by_jobset_dns(topology: str) -> None:
    objects = _render(topology, "single-controller")
    (jobset,) = _kind(objects, "JobSet")
    (service,) = _kind(objects, "Service")
    name, subdomain = jobset["metadata"]["name"], jobset["spec"]["network"]["subdomain"]
    assert service["metadata"]["name"] == subdomain and service["spec"]["clusterIP"] == "None"
    workers, controller = jobset["spec"]["replicatedJobs"]
    assert controller["dependsOn"] == [{"name": workers["name"], "status": "Ready"}]
    assert jobset["spec"]["successPolicy"]["targetReplicatedJobs"] == [controller["name"]]
    spec = _pod_templates(jobset)["controller"]["spec"]
    assert "initContainers" not in spec and "nodeSelector" not in spec  # a CPU pod, no sidecar
    env = _env(spec["containers"][0])
    hosts = TOPOLOGIES[topology].hosts
    # JobSet's pod hostnames: <jobset>-<replicatedJob>-<jobIndex>-<podIndex>.<subdomain>
    expected = [f"{name}-{workers['name']}-0-{i}.{subdomain}:7070" for i in range(hosts)]
    assert env["COLOCAR_SIDECARS"].split(",") == expected
    assert workers["replicas"] == 1


def test_manifest_env_is_what_connect_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from colocar.controller_bridge import cluster

    (jobset,) = _kind(_render("v5e-16", "multi-controller"), "JobSet")
    env = _env(_containers(_pod_templates(jobset)["workers"]["spec"])[TRAINER])
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    monkeypatch.delenv("COLOCAR_TOKEN", raising=False)
    monkeypatch.setenv("COLOCAR_TOKEN_FILE", str(token_file))
    assert Path(env["COLOCAR_TOKEN_FILE"]).name == "token"
    assert cluster._token_from_env(None, None) == "s3cret"
    source = Path(cluster.__file__).read_text()
    assert 'os.environ.get("COLOCAR_SIDECARS"' in source and 'environ.get("COLOCAR_TOKEN_FILE")' in source


# --- security: token, network, identity ---------------------------------------------------------


@pytest.mark.parametrize("topology,variant,extra", ALL)
def test_token_network_and_identity(topology: str, variant: str, extra: tuple[str, ...]) -> None:
    objects = _render(topology, variant, *extra)
    (jobset,) = _kind(objects, "JobSet")
    name = jobset["metadata"]["name"]
    assert _kind(objects, "Secret") == []
    for template in _pod_templates(jobset).values():
        spec = template["spec"]
        secrets = [v["secret"] for v in spec["volumes"] if "secret" in v]
        assert {"secretName": f"{name}-colocar-token", "defaultMode": 0o440} == {
            k: secrets[0][k] for k in ("secretName", "defaultMode")
        }
        assert (
            spec["serviceAccountName"] == f"{name}-colocar" and spec["automountServiceAccountToken"] is False
        )
        for c in _containers(spec).values():
            names = {e["name"] for e in c.get("env", [])}
            assert not names & {"GOOGLE_APPLICATION_CREDENTIALS", "COLOCAR_TOKEN"}
    token_copy = _containers(_pod_templates(jobset)["workers"]["spec"])["colocar-token"]
    assert token_copy["command"][:3] == ["install", "-m", "0600"]
    (sa,) = _kind(objects, "ServiceAccount")
    assert sa["metadata"]["name"] == f"{name}-colocar"
    assert sa["metadata"]["annotations"]["iam.gke.io/gcp-service-account"].endswith(
        ".iam.gserviceaccount.com"
    )
    (policy,) = _kind(objects, "NetworkPolicy")
    job_pods = {"matchLabels": {"jobset.sigs.k8s.io/jobset-name": name}}
    assert policy["spec"]["podSelector"] == job_pods
    port = int(_containers(_pod_templates(jobset)["workers"]["spec"])[SIDECAR]["ports"][0]["containerPort"])
    from_job, others = policy["spec"]["ingress"]
    assert from_job == {"from": [{"podSelector": job_pods}], "ports": [{"protocol": "TCP", "port": port}]}
    assert "from" not in others  # every other port stays open as before; the sidecar port is not among them
    for rule in others["ports"]:
        assert rule["protocol"] != "TCP" or not rule["port"] <= port <= rule["endPort"]


SECRET_PATTERNS = [
    r"-----BEGIN [A-Z ]*PRIVATE KEY-----",
    r"\"private_key\"",
    r"^kind:\s*Secret\b",
    r"^\s*(data|stringData):",
    r"--from-literal=token=[0-9a-f]{16,}",
    r"\b[0-9a-f]{64}\b",  # a token_hex(32)
    r"AIza[0-9A-Za-z_-]{35}",  # a Google API key
]


def test_no_secret_values_in_any_file() -> None:
    files = [p for p in K8S.rglob("*") if p.is_file()]
    assert files
    for path in files:
        text = path.read_text()
        for pattern in SECRET_PATTERNS:
            assert not re.search(pattern, text, re.MULTILINE), f"{path}: matches {pattern}"


# --- committed examples, command line, errors ---------------------------------------------------


def test_examples_equal_render_output() -> None:
    expected = example_files()
    on_disk = {p.name: p.read_text() for p in (K8S / "examples").glob("*.yaml")}
    assert sorted(on_disk) == sorted(expected), "regenerate: python -m colocar.k8s.cli examples k8s/examples"
    for name, text in expected.items():
        assert on_disk[name] == text, (
            f"k8s/examples/{name} is stale; regenerate with `colocar k8s examples k8s/examples`"
        )


def test_render_command_line_matches_example() -> None:
    """End to end: the command in an example's header prints exactly that file."""
    example = K8S / "examples" / "v6e-64.single-controller.yaml"
    text = example.read_text()
    command = re.search(r"^# Generated by: colocar k8s (render .*)$", text, re.MULTILINE)
    assert command is not None
    proc = subprocess.run(
        [sys.executable, "-m", "colocar.k8s.cli", *shlex.split(command.group(1))],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == text
    assert "kubectl create secret generic train-colocar-token" in proc.stderr
    assert "kubectl create" not in proc.stdout and "gcloud" not in proc.stdout


def test_colocar_cli_dispatches_k8s(capsys: pytest.CaptureFixture[str]) -> None:
    from colocar.cli import main as colocar_main

    colocar_main(["k8s", "render", "--topology", "v5p-8", "--image", IMAGE, "--bucket", BUCKET])
    out, err = capsys.readouterr()
    kinds = [d["kind"] for d in yaml.safe_load_all(out)]
    assert kinds == ["ServiceAccount", "Service", "NetworkPolicy", "JobSet"]
    assert "--from-literal=token=" in err and "warning: --gcp-service-account" in err


BAD = [
    (["--topology", "v9-1024"], "--topology 'v9-1024' is unknown; known: v5e-16, v6e-64"),
    (["--bucket", "s3://my-bucket/x"], "expected gs://BUCKET/PREFIX"),
    (["--bucket", "gs://My_Bucket/x"], "is not a bucket name"),
    (["--bucket", "gs:///x"], "is not a bucket name"),
    (["--bucket", "gs://my-bucket//x"], "empty path parts"),
    (["--image", "us-docker.pkg.dev/p/colocar/train"], "has no tag"),
    (["--image", "localhost:5000/train"], "has no tag"),
    (["--image", "train:latest"], "pin a version"),
    (["--trainer-image", "trainer"], "--trainer-image 'trainer' has no tag"),
    (["--name", "Train_1"], "--name 'Train_1'"),
    (["--pool", "ckpt"], "expected NAME=SIZE"),
    (["--pool", "ckpt=8G"], "write a whole number with Mi, Gi or Ti"),
    (["--pool", "ckpt=31Gi"], "lower them or raise --shm-size"),
    (["--shm-size", "512Mi"], "at least 1Gi"),
    (["--variant", "two-controllers"], "choose multi-controller or single-controller"),
    (["--gcp-service-account", "someone@example.com"], "expected NAME@PROJECT.iam.gserviceaccount.com"),
    (["--trainer-command", "python 'unclosed"], "No closing quotation"),
]


@pytest.mark.parametrize("change,message", BAD, ids=[m for _, m in BAD])
def test_bad_input_is_a_clear_error_and_no_output(
    change: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = {"--topology": "v5e-16", "--image": IMAGE, "--bucket": BUCKET}
    args.update(zip(change[::2], change[1::2], strict=True))
    with pytest.raises(SystemExit) as exc:
        main(["render", *[x for kv in args.items() for x in kv]])
    out, err = capsys.readouterr()
    assert exc.value.code == 2
    assert out == ""
    assert message in err


def test_render_requires_its_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["render", "--topology", "v5e-16"])
    out, err = capsys.readouterr()
    assert exc.value.code == 2 and out == "" and "--image" in err


# --- the image recipe and the docs ---------------------------------------------------------------


def _dockerfile() -> tuple[str, list[str]]:
    text = (K8S / "Dockerfile").read_text()
    lines = text.replace("\\\n", " ").splitlines()
    return text, [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]


def test_dockerfile_invariants() -> None:
    text, lines = _dockerfile()
    stages = [ln.split()[-1] for ln in lines if ln.startswith("FROM ")]
    assert stages == ["builder", "sidecar", "user"]  # the last, default target adds EXTRA_PACKAGES
    sidecar = lines[next(i for i, ln in enumerate(lines) if ln.endswith("AS sidecar")) :]
    users = [ln.split()[1] for ln in sidecar if ln.startswith("USER ")]
    assert users[-1] == f"{UID}:{UID}" and users[0] == f"{UID}:{UID}"  # non-root, fixed ids, also in `user`
    assert f"--uid {UID}" in text and f"--gid {UID}" in text
    assert 'ENTRYPOINT ["colocar", "sidecar"]' in lines
    assert any("-slim" in ln for ln in lines if ln.startswith("FROM python:"))
    label = " ".join(ln for ln in lines if ln.startswith("LABEL "))
    for key, arg in (
        ("python", "PYTHON_VERSION"),
        ("jax", "JAX_VERSION"),
        ("cloudpickle", "CLOUDPICKLE_VERSION"),
    ):
        assert f'dev.colocar.{key}="${{{arg}}}"' in label
    assert "ARG EXTRA_PACKAGES" in text and "COPY --from=builder /opt/colocar /opt/colocar" in text


def test_dockerfile_versions_agree_with_pyproject() -> None:
    _, lines = _dockerfile()
    args = dict(ln[4:].split("=", 1) for ln in lines if ln.startswith("ARG ") and "=" in ln)
    with open(REPO / "pyproject.toml", "rb") as f:
        import tomllib

        project = tomllib.load(f)["project"]
    assert args["COLOCAR_VERSION"] == project["version"]
    assert args["PYTHON_VERSION"] in SpecifierSet(project["requires-python"])
    pins = {re.split(r"[<>=!~ ]", d, maxsplit=1)[0]: d for d in project["dependencies"]}
    assert args["JAX_VERSION"] in SpecifierSet(pins["jax"].removeprefix("jax"))
    assert args["CLOUDPICKLE_VERSION"] in SpecifierSet(pins["cloudpickle"].removeprefix("cloudpickle"))


def test_docs_cover_deployment() -> None:
    k8s_readme = (K8S / "README.md").read_text()
    for topology in TOPOLOGIES:
        assert f"`{topology}`" in k8s_readme
    assert "colocar k8s examples k8s/examples" in k8s_readme
    readme = (REPO / "README.md").read_text()
    assert "## Deploy on GKE" in readme
    assert readme.index("## Deploy on GKE") < readme.index("## Repository layout")
