"""Kubernetes manifests (colocar/k8s, k8s/): what controllers read, security (token, network,
identity), the committed examples, the command line, the image recipe and the docs.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from k8s_helpers import (
    ALL,
    BUCKET,
    IMAGE,
    K8S,
    REPO,
    containers_of,
    env_of,
    header_command_output,
    of_kind,
    pod_templates,
    render_case,
)
from packaging.specifiers import SpecifierSet

from colocar.k8s import TOPOLOGIES
from colocar.k8s.cli import example_files, main
from colocar.k8s.pod import SIDECAR, TRAINER, UID

# --- controllers: what colocar.connect() reads -------------------------------------------------


@pytest.mark.parametrize("topology", list(TOPOLOGIES))
def test_multi_controller_trainer_uses_its_own_sidecar(topology: str) -> None:
    (jobset,) = of_kind(render_case(topology, "multi-controller"), "JobSet")
    trainer = containers_of(pod_templates(jobset)["workers"]["spec"])[TRAINER]
    env = env_of(trainer)
    assert env["COLOCAR_SIDECARS"] == "127.0.0.1:7070"
    assert "COLOCAR_TOKEN" not in env  # the value stays in the Secret
    assert env["COLOCAR_BUCKET"] == BUCKET
    if TOPOLOGIES[topology].jax_coordinator:
        assert env["JAX_COORDINATOR_ADDRESS"] == "train-workers-0-0.train:8476"


@pytest.mark.parametrize("topology", list(TOPOLOGIES))
def test_single_controller_finds_sidecars_by_jobset_dns(topology: str) -> None:
    objects = render_case(topology, "single-controller")
    (jobset,) = of_kind(objects, "JobSet")
    (service,) = of_kind(objects, "Service")
    name, subdomain = jobset["metadata"]["name"], jobset["spec"]["network"]["subdomain"]
    assert service["metadata"]["name"] == subdomain and service["spec"]["clusterIP"] == "None"
    workers, controller = jobset["spec"]["replicatedJobs"]
    assert controller["dependsOn"] == [{"name": workers["name"], "status": "Ready"}]
    assert jobset["spec"]["successPolicy"]["targetReplicatedJobs"] == [controller["name"]]
    spec = pod_templates(jobset)["controller"]["spec"]
    assert "initContainers" not in spec and "nodeSelector" not in spec  # a CPU pod, no sidecar
    env = env_of(spec["containers"][0])
    hosts = TOPOLOGIES[topology].hosts
    # JobSet's pod hostnames: <jobset>-<replicatedJob>-<jobIndex>-<podIndex>.<subdomain>
    expected = [f"{name}-{workers['name']}-0-{i}.{subdomain}:7070" for i in range(hosts)]
    assert env["COLOCAR_SIDECARS"].split(",") == expected
    assert workers["replicas"] == 1


def test_manifest_env_is_what_connect_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from colocar.controller_bridge import addresses

    (jobset,) = of_kind(render_case("v5e-16", "multi-controller"), "JobSet")
    env = env_of(containers_of(pod_templates(jobset)["workers"]["spec"])[TRAINER])
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    monkeypatch.delenv("COLOCAR_TOKEN", raising=False)
    monkeypatch.setenv("COLOCAR_TOKEN_FILE", str(token_file))
    assert Path(env["COLOCAR_TOKEN_FILE"]).name == "token"
    assert addresses.token_from_env(None, None) == "s3cret"
    source = Path(addresses.__file__).read_text()
    assert 'os.environ.get("COLOCAR_SIDECARS"' in source and 'environ.get("COLOCAR_TOKEN_FILE")' in source


# --- security: token, network, identity ---------------------------------------------------------


@pytest.mark.parametrize("topology,variant,extra", ALL)
def test_token_network_and_identity(topology: str, variant: str, extra: tuple[str, ...]) -> None:
    objects = render_case(topology, variant, *extra)
    (jobset,) = of_kind(objects, "JobSet")
    name = jobset["metadata"]["name"]
    assert of_kind(objects, "Secret") == []
    for template in pod_templates(jobset).values():
        spec = template["spec"]
        secrets = [v["secret"] for v in spec["volumes"] if "secret" in v]
        assert {"secretName": f"{name}-colocar-token", "defaultMode": 0o440} == {
            k: secrets[0][k] for k in ("secretName", "defaultMode")
        }
        assert (
            spec["serviceAccountName"] == f"{name}-colocar" and spec["automountServiceAccountToken"] is False
        )
        for c in containers_of(spec).values():
            names = {e["name"] for e in c.get("env", [])}
            assert not names & {"GOOGLE_APPLICATION_CREDENTIALS", "COLOCAR_TOKEN"}
    token_copy = containers_of(pod_templates(jobset)["workers"]["spec"])["colocar-token"]
    assert token_copy["command"][:3] == ["install", "-m", "0600"]
    (sa,) = of_kind(objects, "ServiceAccount")
    assert sa["metadata"]["name"] == f"{name}-colocar"
    assert sa["metadata"]["annotations"]["iam.gke.io/gcp-service-account"].endswith(
        ".iam.gserviceaccount.com"
    )
    (policy,) = of_kind(objects, "NetworkPolicy")
    job_pods = {"matchLabels": {"jobset.sigs.k8s.io/jobset-name": name}}
    assert policy["spec"]["podSelector"] == job_pods
    port = int(containers_of(pod_templates(jobset)["workers"]["spec"])[SIDECAR]["ports"][0]["containerPort"])
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
        # A ConfigMap (the pool's tenants file) has `data:` too; the other patterns still apply to it.
        docs = re.split(r"^---$", text, flags=re.MULTILINE)
        not_config = "\n".join(d for d in docs if not re.search(r"^kind:\s*ConfigMap\b", d, re.MULTILINE))
        for pattern in SECRET_PATTERNS:
            checked = not_config if pattern == SECRET_PATTERNS[3] else text
            assert not re.search(pattern, checked, re.MULTILINE), f"{path}: matches {pattern}"


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
    text, proc = header_command_output(example)
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
    (["--bucket", "gs://My_Bucket/x"], "GCS bucket names are lower case"),
    (["--bucket", "gs://-bucket/x"], "is not a bucket name"),
    (["--bucket", "gs:///x"], "is not a bucket name"),
    (["--bucket", "gs://my-bucket//x"], "empty path parts"),
    (["--image", "us-docker.pkg.dev/p/colocar/train"], "has no tag"),
    (["--image", "localhost:5000/train"], "has no tag"),
    (["--image", "train:latest"], "pin a version"),
    (["--trainer-image", "trainer"], "--trainer-image 'trainer' has no tag"),
    (["--name", "Train_1"], "--name 'Train_1'"),
    (["--arena-pool", "ckpt"], "expected NAME=SIZE"),
    (["--arena-pool", "ckpt=8X"], "'8X' is not a size"),
    (["--arena-pool", "ckpt=1000"], "positive whole number of MiB"),
    (["--arena-pool", "ckpt=31Gi"], "lower them or raise --shm-size"),
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
    page = (REPO / "docs" / "kubernetes.md").read_text()
    assert page.startswith("# Kubernetes: deploy on GKE") and "colocar k8s render" in page
    assert "(docs/kubernetes.md)" in (REPO / "README.md").read_text()
