"""`colocar k8s render --pool`: the manifests of a shared sidecar pool (node pods, agent,
Secrets, tenants ConfigMap, Services, NetworkPolicies), validated offline like the job's
(kubernetes-validate's 1.33 schemas, the PodMonitoring CRD copy in tests/data/schemas), with
the node's and the agent's flags parsed by their own parsers.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
from k8s_helpers import (
    BASE,
    IMAGE,
    K8S,
    K8S_VERSION,
    POD_MONITORING_CRD,
    POOL_TENANTS,
    containers_of,
    header_command_output,
    load_crd_schema,
    mounted,
    of_kind,
    one,
    pod_spec,
    pool_case,
    render_main,
    secret_of,
    tokens_of,
    unknown_fields,
)

from colocar.k8s import TOPOLOGIES
from colocar.k8s.cli import EXAMPLE_TENANTS, pool_example_files
from colocar.k8s.options import parse_size
from colocar.k8s.pod import UID
from colocar.k8s.pool.render import join_snippet, render_pool
from colocar.pool import agent_main, tenants
from colocar.sidecar.auth import UnsafeConfigError, read_token_file
from colocar.sizes import parse_size as agent_size

EXTRA = ["--name", "shared", "--namespace", "ml", "--port", "50051", "--capacity", "2G", "--pod-monitoring"]
CASES = [pytest.param(t, (), id=t) for t in TOPOLOGIES] + [
    pytest.param("v5e-16", tuple(EXTRA), id="v5e-16-extra"),
    pytest.param("a3-16", ("--no-secrets", "--metrics-port", "0"), id="a3-16-no-secrets"),
]
KINDS = ["ConfigMap", "Service", "Service", "NetworkPolicy", "NetworkPolicy", "StatefulSet", "Deployment"]


# --- schemas and names ----------------------------------------------------------------------------


@pytest.mark.parametrize("topology,extra", CASES)
def test_pool_objects_validate_strict(topology: str, extra: tuple[str, ...]) -> None:
    objects, opts = pool_case(topology, *extra)
    secrets = [] if "--no-secrets" in extra else ["Secret"] * (2 + len(opts.tenants))
    monitoring = ["PodMonitoring"] if "--pod-monitoring" in extra else []
    assert [o["kind"] for o in objects] == secrets + KINDS + monitoring
    for obj in objects:
        if obj["kind"] == "PodMonitoring":
            continue
        assert kubernetes_validate.validate(obj, K8S_VERSION, strict=True) == K8S_VERSION
        assert obj["metadata"]["namespace"] == opts.namespace  # baked into the node addresses
    for obj in of_kind(objects, "PodMonitoring"):
        schema = load_crd_schema(POD_MONITORING_CRD, "v1")
        jsonschema.validators.validator_for(schema)(schema).validate(obj)
        assert unknown_fields(obj, schema) == []
        labels = one(objects, "Deployment")["spec"]["template"]["metadata"]["labels"]
        assert obj["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_secrets_hold_fresh_distinct_tokens_under_valid_names() -> None:
    objects, opts = pool_case("v5e-16")
    tokens = tokens_of(objects)
    assert sorted(tokens) == sorted(["pool-admin", "pool-node", "pool-tenant-alice", "pool-tenant-team-b"])
    assert all(re.fullmatch(r"[0-9a-f]{64}", t) for t in tokens.values()) and len(set(tokens.values())) == 4
    assert all(s["type"] == "Opaque" and list(s["data"]) == ["token"] for s in of_kind(objects, "Secret"))
    again, _ = pool_case("v5e-16")
    assert not set(tokens_of(again).values()) & set(tokens.values())  # each render: new tokens
    made = iter(f"token-{i}" for i in range(10))
    injected = render_pool(opts, token=lambda: next(made))
    assert sorted(tokens_of(injected).values()) == [f"token-{i}" for i in range(4)]
    names = [o["metadata"]["name"] for o in objects if o["kind"] in ("Secret", "ConfigMap")]
    assert all(re.fullmatch(r"[a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?", n) for n in names)


# --- the node pods --------------------------------------------------------------------------------


@pytest.mark.parametrize("topology,extra", CASES)
def test_node_pods(topology: str, extra: tuple[str, ...]) -> None:
    objects, opts = pool_case(topology, *extra)
    topo = TOPOLOGIES[topology]
    sts = one(objects, "StatefulSet")
    assert sts["spec"]["replicas"] == topo.hosts and sts["spec"]["podManagementPolicy"] == "Parallel"
    headless = next(
        s for s in of_kind(objects, "Service") if s["metadata"]["name"] == sts["spec"]["serviceName"]
    )
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert headless["spec"]["selector"] == labels == sts["spec"]["selector"]["matchLabels"]
    spec = pod_spec(objects, "StatefulSet")
    assert spec["nodeSelector"] == topo.node_selector and spec["tolerations"] == topo.tolerations
    (anti,) = spec["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti == {"labelSelector": {"matchLabels": labels}, "topologyKey": "kubernetes.io/hostname"}
    node = containers_of(spec)["colocar-pool-node"]
    assert node["command"] == ["colocar", "pool", "node"]
    env = {e["name"]: e for e in node["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["COLOCAR_NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert node["securityContext"]["runAsUser"] == UID and node["securityContext"]["runAsNonRoot"]
    assert node["readinessProbe"]["tcpSocket"]["port"] == opts.port == node["ports"][0]["containerPort"]
    memory = parse_size(node["resources"]["limits"]["memory"], "memory")
    assert memory == opts.capacity_bytes + opts.sidecar_memory_bytes  # the arenas' tmpfs pages count here
    args = node["args"]
    shm_volume, _ = mounted(spec, node, args[args.index("--shm-dir") + 1] + "/x")
    assert shm_volume["hostPath"] == {
        "path": f"/dev/shm/colocar-pool-{opts.name}",
        "type": "DirectoryOrCreate",
    }
    init = containers_of(spec)["colocar-pool-shm"]["command"]
    assert init[:6] == ["install", "-d", "-o", str(UID), "-g", str(UID)]
    assert init[-1] == args[args.index("--shm-dir") + 1]  # the folder the node writes is UID 10001's


def test_node_flags_parse_with_the_node_parser() -> None:
    node_main = pytest.importorskip("colocar.pool.node_main")
    if not hasattr(node_main, "build_parser"):
        pytest.skip("colocar.pool.node_main has no build_parser() yet")
    objects, opts = pool_case("v5e-16", *EXTRA)
    spec = pod_spec(objects, "StatefulSet")
    node = containers_of(spec)["colocar-pool-node"]
    args = node_main.build_parser().parse_args(node["args"])
    assert args.address == f"0.0.0.0:{opts.port}" and args.advertise == "$(POD_IP)"
    assert args.shm_dir == "/colocar-pool/shm" and args.workdir.startswith("/tmp/")
    volume, inner = mounted(spec, node, args.token_file)
    assert "emptyDir" in volume  # a 0600 copy of the node Secret, made by an init container
    copy = containers_of(spec)["colocar-node-token"]["command"]
    assert (
        copy[:7] == ["install", "-o", str(UID), "-g", str(UID), "-m", "0600"] and copy[-1] == args.token_file
    )
    source, _ = mounted(spec, containers_of(spec)["colocar-node-token"], copy[-2])
    assert secret_of(source, inner) == (f"{opts.name}-node", "token")


# --- the agent ------------------------------------------------------------------------------------


def _agent_args(objects: list[dict[str, Any]]) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    spec = pod_spec(objects, "Deployment")
    agent = containers_of(spec)["colocar-pool-agent"]
    assert agent["command"] == ["python", "-m", "colocar.pool.agent_main"]
    argv = list(agent["args"])
    parser = agent_main.build_parser()
    known = {s for a in parser._actions for s in a.option_strings}
    if not {"--nodes", "--node-token-file"} <= known:
        for flag in ("--nodes", "--node-token-file"):  # what can be checked without them
            del argv[argv.index(flag) : argv.index(flag) + 2]
        parser.parse_args(argv)
        pytest.skip("colocar.pool.agent_main has no --nodes/--node-token-file yet")
    return parser.parse_args(argv), spec, agent


@pytest.mark.parametrize("topology,extra", CASES)
def test_agent_flags_parse_and_name_every_node(topology: str, extra: tuple[str, ...]) -> None:
    objects, opts = pool_case(topology, *extra)
    args, spec, agent = _agent_args(objects)
    sts = one(objects, "StatefulSet")
    nodes, service = sts["metadata"]["name"], sts["spec"]["serviceName"]
    port = containers_of(pod_spec(objects, "StatefulSet"))["colocar-pool-node"]["ports"][0]["containerPort"]
    expected = [
        f"{nodes}-{i}.{service}.{opts.namespace}.svc:{port}" for i in range(TOPOLOGIES[topology].hosts)
    ]
    assert args.nodes.split(",") == expected
    assert (
        agent_size(args.capacity) == opts.capacity_bytes and args.max_tenants == 8 and args.idle_seconds == 60
    )
    assert args.address == f"0.0.0.0:{opts.port}"
    assert (args.metrics_port, args.metrics_host) == (
        (None, "127.0.0.1") if "--metrics-port" in extra else (9464, "0.0.0.0")
    )
    for path, secret in ((args.admin_token_file, "admin"), (args.node_token_file, "node")):
        assert secret_of(*mounted(spec, agent, path)) == (f"{opts.name}-{secret}", "token")
    config, name = mounted(spec, agent, args.tenants)
    assert (
        config["configMap"]["name"] == one(objects, "ConfigMap")["metadata"]["name"]
        and name == "tenants.yaml"
    )
    agent_service = next(s for s in of_kind(objects, "Service") if s["metadata"]["name"] == opts.name)
    assert agent_service["spec"]["selector"] == one(objects, "Deployment")["spec"]["selector"]["matchLabels"]
    assert one(objects, "Deployment")["spec"]["strategy"] == {"type": "Recreate"}  # never two agents


def test_tenants_config_map_parses_and_reads_each_tenants_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    objects, opts = pool_case("v5e-16", "--name", "shared")
    spec = pod_spec(objects, "Deployment")
    agent = containers_of(spec)["colocar-pool-agent"]
    tokens = tokens_of(objects)

    def from_secret(path: str) -> str:  # what the agent reads at `path`: the Secret mounted there
        name, key = secret_of(*mounted(spec, agent, path))
        assert key == "token"
        return tokens[name]

    monkeypatch.setattr(tenants, "read_token_file", from_secret)
    text = one(objects, "ConfigMap")["data"]["tenants.yaml"]
    found = tenants.parse(text, "/nowhere")
    assert list(found) == ["alice", "team-b"] == list(opts.tenants)
    for name, t in found.items():
        assert t.token_file == f"/etc/colocar/tenants/{name}/token"
        assert t.token == tokens[f"shared-tenant-{name}"]
    assert (found["alice"].priority, found["alice"].arena, found["alice"].processes) == (10, 512 << 20, 0)
    assert found["team-b"].quotas() == tenants.DEFAULT_QUOTAS
    assert all("subPath" not in m for m in agent["volumeMounts"])  # kubelet updates them in place


def test_mounted_secret_files_pass_the_agents_token_check(tmp_path: Path) -> None:
    """Kubernetes' layout of a Secret volume: `token` -> `..data/token`, `..data` -> a dated
    folder. The rendered mode (0400, no fsGroup: root-owned) passes `read_token_file`; the
    0440 an fsGroup would make is refused."""
    objects, _ = pool_case("v5e-16")
    spec = pod_spec(objects, "Deployment")
    agent = containers_of(spec)["colocar-pool-agent"]
    assert "securityContext" not in spec or "fsGroup" not in spec["securityContext"]
    assert agent["securityContext"]["runAsUser"] == 0  # the files' owner; no capabilities
    assert agent["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    modes = {v.get("secret", v.get("projected", {})).get("defaultMode") for v in spec["volumes"]} - {None}
    assert modes == {0o400}
    for mode, ok in ((0o400, True), (0o440, False)):
        volume = tmp_path / f"mode-{mode:o}"
        (volume / "..2026_01_01").mkdir(parents=True)
        (volume / "..2026_01_01" / "token").write_text("s3cret\n")
        os.chmod(volume / "..2026_01_01" / "token", mode)
        os.symlink("..2026_01_01", volume / "..data")
        os.symlink("..data/token", volume / "token")
        if ok:
            assert read_token_file(str(volume / "token")) == "s3cret"
        else:
            with pytest.raises(UnsafeConfigError):
                read_token_file(str(volume / "token"))


# --- network, and how a job joins -----------------------------------------------------------------


def test_network_policies_admit_the_pools_jobs_only() -> None:
    objects, opts = pool_case("a3-16", "--port", "50051")
    agent_policy, node_policy = of_kind(objects, "NetworkPolicy")
    agent_labels = one(objects, "Deployment")["spec"]["template"]["metadata"]["labels"]
    node_labels = one(objects, "StatefulSet")["spec"]["template"]["metadata"]["labels"]
    jobs = {"podSelector": {"matchLabels": {"colocar.dev/pool": opts.name}}}
    assert agent_policy["spec"]["podSelector"]["matchLabels"] == agent_labels
    first, others = agent_policy["spec"]["ingress"]
    assert first == {"from": [jobs], "ports": [{"protocol": "TCP", "port": 50051}]}
    assert "from" not in others and all(
        p["protocol"] != "TCP" or not p["port"] <= 50051 <= p["endPort"] for p in others["ports"]
    )
    assert node_policy["spec"]["podSelector"]["matchLabels"] == node_labels
    (rule,) = node_policy["spec"]["ingress"]
    assert rule["from"] == [jobs, {"podSelector": {"matchLabels": agent_labels}}]
    assert rule["ports"] == [{"protocol": "TCP", "port": 1, "endPort": 65535}]


def test_join_snippet_makes_a_valid_pod_that_uses_the_pool() -> None:
    objects, opts = pool_case("v5e-16", "--namespace", "ml")
    snippet = join_snippet(opts, "alice")
    snippet["spec"]["containers"][0]["image"] = IMAGE
    metadata = {"name": "job-0", **snippet["metadata"]}
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": snippet["spec"]}
    assert kubernetes_validate.validate(pod, K8S_VERSION, strict=True) == K8S_VERSION
    node_spec = pod_spec(objects, "StatefulSet")
    node = containers_of(node_spec)["colocar-pool-node"]
    trainer = pod["spec"]["containers"][0]
    shm_dir = node["args"][node["args"].index("--shm-dir") + 1]
    theirs, _ = mounted(node_spec, node, shm_dir + "/arena")
    mine, _ = mounted(pod["spec"], trainer, shm_dir + "/arena")  # the same path in both pods
    assert mine["hostPath"]["path"] == theirs["hostPath"]["path"]
    (affinity,) = pod["spec"]["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert (
        affinity["labelSelector"]["matchLabels"]
        == one(objects, "StatefulSet")["spec"]["selector"]["matchLabels"]
    )
    assert affinity["topologyKey"] == "kubernetes.io/hostname"
    env = {e["name"]: e for e in trainer["env"]}
    volume, _ = mounted(pod["spec"], trainer, env["COLOCAR_TOKEN_FILE"]["value"])
    assert volume["secret"]["secretName"] in tokens_of(objects)
    policy = of_kind(objects, "NetworkPolicy")[0]["spec"]["ingress"][0]["from"][0]["podSelector"][
        "matchLabels"
    ]
    assert policy.items() <= pod["metadata"]["labels"].items()
    assert opts.agent_address == f"{opts.name}.ml.svc:{opts.port}"
    assert opts.name in [s["metadata"]["name"] for s in of_kind(objects, "Service")]


# --- the command line, errors, examples ------------------------------------------------------------


def test_render_prints_tokens_commands_and_how_to_join(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "tenants.yaml").write_text(POOL_TENANTS)
    code, out, err = render_main(["--topology", "v5p-8", *BASE], tmp_path, capsys)
    assert code == 0 and "holds fresh tokens" in out.split("---")[0]
    assert "kubectl get secret pool-tenant-alice -n default -o jsonpath='{.data.token}' | base64 -d" in err
    assert 'colocar.connect(pool="pool.default.svc:7070")' in err and "colocar.dev/pool: pool" in err
    assert "kubectl create secret" not in err  # the Secrets are in the YAML
    code, out, err = render_main(["--topology", "v5p-8", *BASE, "--no-secrets"], tmp_path, capsys)
    assert code == 0 and "kind: Secret" not in out and not re.search(r"[0-9a-f]{64}", out)
    assert err.count("kubectl create secret generic pool-") == 4


BAD = [
    (["--tenants"], None, "--tenants: expected one argument"),
    ([], "tenants: [alice", "not YAML"),
    ([], "tenants:\n  alice: {quota: {arena: 1G}}\n", "unknown keys ['quota']"),
    ([], "tenants:\n  alice: {quotas: {arena: lots}}\n", "tenant 'alice'"),
    ([], "tenants:\n  Alice_1: {}\n", "e.g. 'alice-1'"),
    ([], "tenants: {}\n", "at least one"),
    (["--capacity", "256M"], POOL_TENANTS, "more than the pool's --capacity"),
    (["--bucket", "gs://my-bucket/x"], POOL_TENANTS, "--bucket: applies to a job's manifests, not to --pool"),
    (["--pool", "ckpt=8G"], POOL_TENANTS, "write --arena-pool ckpt=8G"),
    (["--name", "Pool"], POOL_TENANTS, "--name 'Pool'"),
    (["--max-tenants", "0"], POOL_TENANTS, "serve at least one tenant"),
]


@pytest.mark.parametrize("change,text,message", BAD, ids=[m for _, _, m in BAD])
def test_bad_pool_input_is_a_clear_error(
    change: list[str], text: str | None, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if text is not None:
        (tmp_path / "tenants.yaml").write_text(text)
    code, out, err = render_main(["--topology", "v5e-16", *BASE, *change], tmp_path, capsys)
    assert (code, out) == (2, "") and message in err


def test_pool_flags_and_the_old_pool_spelling(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job = ["--topology", "v5e-16", "--image", IMAGE, "--bucket", "gs://my-bucket/x"]
    for change, message in (
        (
            ["--pool", "ckpt=8Gi"],
            "--pool now renders a shared sidecar pool; to reserve part of a job's "
            "arena, write --arena-pool ckpt=8Gi",
        ),  # fmt: skip
        (["--pool=ring=1G"], "write --arena-pool ring=1G"),
        (["--tenants", "t.yaml"], "--tenants: applies to --pool only"),
        (["--pool"], "--bucket: applies to a job's manifests"),
    ):
        code, out, err = render_main([*job, *change], tmp_path, capsys)
        assert (code, out) == (2, "") and message in err, err
    pool = ["--topology", "v5e-16", "--image", IMAGE, "--pool"]
    code, out, err = render_main(pool, tmp_path, capsys)
    assert (code, out) == (2, "") and "--pool needs --tenants FILE" in err
    code, out, err = render_main([*pool, "--tenants", "missing.yaml"], tmp_path, capsys)
    assert (code, out) == (2, "") and "--tenants missing.yaml: No such file" in err
    code, out, err = render_main(["--topology", "v5e-16", "--image", IMAGE], tmp_path, capsys)
    assert (code, out) == (2, "") and "required: --bucket" in err
    code, out, _ = render_main([*job, "--arena-pool", "ckpt=8Gi"], tmp_path, capsys)
    assert code == 0 and re.search(r"- --pool\n *- ckpt=8G\n", out)  # the sidecar's own flag keeps its name


def test_pool_examples_equal_render_output() -> None:
    expected = pool_example_files()
    on_disk = {p.name: p.read_text() for p in (K8S / "examples" / "pool").glob("*")}
    regenerate = "regenerate: colocar k8s examples --pool k8s/examples/pool"
    assert sorted(on_disk) == sorted(expected), regenerate
    for name, text in expected.items():
        assert on_disk[name] == text, f"k8s/examples/pool/{name} is stale; {regenerate}"
    assert on_disk["tenants.yaml"] == EXAMPLE_TENANTS
    assert {"v5e-16.yaml", "a3-16.yaml"} <= set(on_disk)  # one TPU, one GPU topology


def test_pool_example_header_command_prints_that_file() -> None:
    text, proc = header_command_output(K8S / "examples" / "pool" / "a3-16.yaml")
    assert proc.stdout == text
    assert "kubectl create secret generic pool-tenant-research" in proc.stderr
