"""The sidecar's Prometheus endpoint (`--metrics-port`, colocar/sidecar/metrics.py), scraped over
HTTP while real work runs through it: calls and an error, a held arena block, a loader pipeline,
a checkpoint save. Also: off by default, a port in use fails the start clearly, the endpoint
closes with the sidecar, and `colocar k8s render` turns it on (annotations, PodMonitoring).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jsonschema
import numpy as np
import psutil
import pytest
import yaml
from helpers import wait_for
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from k8s_helpers import EXAMPLE_ARGS, REPO, containers_of, of_kind, pod_templates, unknown_fields
from loaders_helpers import config, labels
from prometheus_client.parser import text_string_to_metric_families
from security_helpers import DEADLINE, SHM_DIR, kill_sidecar, sidecar_argv

import colocar
from colocar import loaders
from colocar.checkpoint import CheckpointError, CheckpointManager
from colocar.checkpoint.format import layout
from colocar.k8s import RenderError, build_options
from colocar.k8s.cli import render_text
from colocar.k8s.pod import METRICS_PATH, SIDECAR
from colocar.protocol import versions
from colocar.protocol.tokens import new_token, write_token_file
from colocar.sidecar import metrics
from colocar.sidecar.server import build_parser

LABEL = "metrics-host0"
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


# --- a sidecar process and its scrapes ---------------------------------------------------------
@contextlib.contextmanager
def sidecar(workdir: Path, *flags: str) -> Iterator[tuple[subprocess.Popen, dict[str, Any], str]]:
    """`python -m colocar.sidecar` with a token and `flags`: (process, ready-file info, token);
    killed after, its arena removed."""
    name = uuid.uuid4().hex[:8]
    ready, log, token_file = (workdir / f"{name}.{ext}" for ext in ("ready", "log", "token"))
    token = new_token()
    write_token_file(str(token_file), token)
    argv = sidecar_argv("--ready-file", str(ready), "--token-file", str(token_file), "--label", LABEL, *flags)
    with open(log, "wb") as out:
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    info: dict[str, Any] = {}
    try:
        wait_for(lambda: ready.exists() or process.poll() is not None, "the sidecar's ready file")
        assert ready.exists(), f"sidecar exited with {process.returncode}:\n{log.read_text()}"
        info = json.loads(ready.read_text())
        yield process, info, token
    finally:
        kill_sidecar(process, info.get("arena"))


def scrape(address: str) -> Samples:
    """Every sample of the endpoint, parsed as Prometheus would: (name, labels) -> value."""
    with urllib.request.urlopen(f"http://{address}{METRICS_PATH}", timeout=30) as reply:
        text = reply.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    """The one sample of `name` with `labels` (and the sidecar's host label)."""
    wanted = {"host": LABEL, **labels}.items()
    found = [v for (n, ls), v in samples.items() if n == name and wanted <= ls]
    assert len(found) == 1, f"{name}{labels}: {len(found)} samples"
    return found[0]


def grew(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


@colocar.colocated
def add_one(x):
    return x + 1


@colocar.colocated
def fail():
    raise ValueError("counted")


@colocar.colocated
def filled(n):
    return np.full(n, 7.0, np.float32)


# --- counters move with the work --------------------------------------------------------------
def _calls_errors_and_a_held_block(c: colocar.Cluster, address: str) -> None:
    host = c.hosts[0]
    before = scrape(address)
    assert [add_one.on(host)(i) for i in range(5)] == [1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match="counted"):
        fail.on(host)()
    block = filled.on(host)(1 << 18)  # 1 MiB, in a block of the arena while we hold it
    held = scrape(address)
    assert grew(before, held, "colocar_calls_total") == 7
    assert grew(before, held, "colocar_call_errors_total") == 1
    assert grew(before, held, "colocar_call_duration_seconds_count") == 7
    assert value(held, "colocar_sessions") == 1
    used = value(held, "colocar_arena_pool_used_bytes", pool="default")
    assert used >= block.nbytes + value(before, "colocar_arena_pool_used_bytes", pool="default")
    assert value(held, "colocar_arena_pool_peak_bytes", pool="default") >= used
    reserved = value(held, "colocar_arena_pool_reserved_bytes", pool="default")
    assert value(held, "colocar_arena_pool_free_bytes", pool="default") == reserved - used
    assert np.all(block == 7.0)
    del block  # its lease goes back in the background: the next scrapes see the block freed
    wait_for(
        lambda: value(scrape(address), "colocar_arena_pool_used_bytes", pool="default") <= used - (1 << 20),
        "the released block to leave the pool's used bytes",
    )


def _a_loader_run(c: colocar.Cluster, address: str) -> None:
    before = scrape(address)
    with loaders.load(config(num_epochs=1, prefetch=3), c, c.mesh(("data",))) as it:
        batch = next(it)
        running = scrape(address)
        assert value(running, "colocar_loader_pipelines") == 1
        assert value(running, "colocar_loader_ring_slots") == 3
        assert value(running, "colocar_loader_ring_slots_in_use") >= 1  # the batch we hold
        assert len(labels(batch)) == 16
        for _ in range(2):
            next(it)
        del batch
    after = scrape(address)
    assert grew(before, after, "colocar_loader_batches_total") >= 3
    assert value(after, "colocar_loader_pipelines") == 0


def _a_checkpoint_save(c: colocar.Cluster, address: str, directory: Path) -> None:
    before = scrape(address)
    sharding = NamedSharding(c.mesh(("data",)), P("data"))
    weights = jax.device_put(np.arange(1 << 16, dtype=np.float32), sharding)
    mngr = CheckpointManager(str(directory), c)
    try:
        mngr.save(1, {"w": weights})
        mngr.wait()
        after = scrape(address)
        assert grew(before, after, "colocar_checkpoint_written_bytes_total") >= weights.nbytes
        assert grew(before, after, "colocar_checkpoint_saves_total", outcome="committed") == 1
        assert grew(before, after, "colocar_checkpoint_saves_total", outcome="failed") == 0
        assert grew(before, after, "colocar_checkpoint_save_duration_seconds_count") == 1
        # A save that fails in the writer (a directory where step 2's heartbeat goes) is counted.
        os.makedirs(directory / layout.step_dir(2) / layout.HEARTBEAT / "x")
        mngr.save(2, {"w": weights})
        wait_for(
            lambda: grew(after, scrape(address), "colocar_checkpoint_saves_total", outcome="failed") == 1,
            "the failed save to be counted",
        )
        with pytest.raises(CheckpointError, match="save of step 2 failed"):
            mngr.wait()
    finally:
        mngr.close()
    final = scrape(address)  # the abort that followed is not a second failure
    assert grew(after, final, "colocar_checkpoint_saves_total", outcome="failed") == 1
    assert grew(after, final, "colocar_checkpoint_saves_total", outcome="committed") == 0
    assert grew(after, final, "colocar_checkpoint_save_duration_seconds_count") == 0


def test_scraped_counters_follow_calls_blocks_batches_and_saves(tmp_path: Path) -> None:
    with sidecar(tmp_path, "--metrics-port", "0") as (process, info, token):
        address = info["metrics"]
        assert address.startswith("127.0.0.1:")  # loopback unless --metrics-host says otherwise
        first = scrape(address)
        assert value(first, "colocar_sidecar_info", version=versions.colocar_version()) == 1
        assert value(first, "colocar_calls_total") == 0
        with colocar.connect(info["address"], token=token) as c:
            _calls_errors_and_a_held_block(c, address)
            _a_loader_run(c, address)
            _a_checkpoint_save(c, address, tmp_path / "ckpt")
        wait_for(lambda: value(scrape(address), "colocar_sessions") == 0, "the session to close")
        # SIGTERM: the sidecar drains, exits 0 and its metrics port is closed.
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=DEADLINE) == 0
        with pytest.raises(urllib.error.URLError):
            scrape(address)


# --- off by default, errors, one registry per endpoint -----------------------------------------
def _listening_ports(pid: int) -> set[int]:
    connections = psutil.Process(pid).net_connections(kind="tcp")
    return {c.laddr.port for c in connections if c.status == psutil.CONN_LISTEN}


def test_no_metrics_port_unless_asked(tmp_path: Path) -> None:
    assert build_parser().parse_args([]).metrics_port is None
    with sidecar(tmp_path) as (process, info, _):
        assert "metrics" not in info
        assert _listening_ports(process.pid) == {int(info["address"].rsplit(":", 1)[1])}


def test_a_metrics_port_in_use_fails_the_start_and_names_the_flag(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        before = set(os.listdir(SHM_DIR))
        argv = sidecar_argv("--metrics-port", str(port))
        result = subprocess.run(argv, capture_output=True, text=True, timeout=DEADLINE)
    assert result.returncode != 0
    assert f"cannot serve metrics on 127.0.0.1:{port} (--metrics-host, --metrics-port)" in result.stderr
    assert "Traceback" not in result.stderr
    assert set(os.listdir(SHM_DIR)) == before  # failed before an arena was made


def test_endpoints_in_one_process_have_registries_of_their_own() -> None:
    a = metrics.MetricsEndpoint("127.0.0.1", 0, "a")
    b = metrics.MetricsEndpoint("127.0.0.1", 0, "b")
    try:
        assert a.registry is not b.registry
        hosts = {dict(ls)["host"] for (n, ls), _ in scrape(b.address).items() if n == "colocar_sidecar_info"}
        assert hosts == {"b"}
    finally:
        a.close()
        b.close()
    with pytest.raises(urllib.error.URLError):
        scrape(a.address)


# --- Kubernetes: on in the rendered manifests ---------------------------------------------------
def _render(*extra: str) -> list[dict[str, Any]]:
    text, _ = render_text(["--topology", "v5e-16", *EXAMPLE_ARGS, *extra])
    return list(yaml.safe_load_all(text))


def _pod_monitoring_schema() -> dict[str, Any]:
    with open(REPO / "tests" / "data" / "schemas" / "monitoring.googleapis.com_podmonitorings.yaml") as f:
        crd = yaml.safe_load(f)
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return version["schema"]["openAPIV3Schema"]


def test_rendered_host_pods_serve_metrics_with_scrape_annotations() -> None:
    (jobset,) = of_kind(_render(), "JobSet")
    template = pod_templates(jobset)["workers"]
    sidecar = containers_of(template["spec"])[SIDECAR]
    args = build_parser().parse_args(sidecar["args"])
    assert (args.metrics_host, args.metrics_port) == ("0.0.0.0", 9464)
    assert {"name": "metrics", "containerPort": 9464, "protocol": "TCP"} in sidecar["ports"]
    annotations = template["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == "9464"
    assert annotations["prometheus.io/path"] == METRICS_PATH == metrics.PATH
    # The NetworkPolicy admits only the job's pods to the sidecar port; scrapers reach the metrics port.
    (policy,) = of_kind(_render(), "NetworkPolicy")
    open_ports = policy["spec"]["ingress"][1]["ports"]
    assert any(p["protocol"] == "TCP" and p["port"] <= 9464 <= p["endPort"] for p in open_ports)
    assert not of_kind(_render(), "PodMonitoring")  # only when asked: it needs GKE's CRD


def test_pod_monitoring_validates_and_selects_the_host_pods() -> None:
    objects = _render("--pod-monitoring", "--metrics-port", "9100", "--name", "llama")
    (monitoring,) = of_kind(objects, "PodMonitoring")
    schema = _pod_monitoring_schema()
    jsonschema.validators.validator_for(schema)(schema).validate(monitoring)
    assert unknown_fields(monitoring, schema) == []
    assert monitoring["apiVersion"] == "monitoring.googleapis.com/v1"
    (endpoint,) = monitoring["spec"]["endpoints"]
    assert endpoint["port"] == "metrics" and endpoint["path"] == METRICS_PATH
    (jobset,) = of_kind(objects, "JobSet")
    pods = pod_templates(jobset)
    selector = monitoring["spec"]["selector"]["matchLabels"]
    host_labels = {**pods["workers"]["metadata"]["labels"], "jobset.sigs.k8s.io/jobset-name": "llama"}
    assert selector.items() <= host_labels.items()
    sidecar = containers_of(pods["workers"]["spec"])[SIDECAR]
    assert {"name": "metrics", "containerPort": 9100, "protocol": "TCP"} in sidecar["ports"]


def test_metrics_port_zero_renders_no_endpoint_and_bad_ports_are_refused() -> None:
    (jobset,) = of_kind(_render("--metrics-port", "0"), "JobSet")
    template = pod_templates(jobset)["workers"]
    sidecar = containers_of(template["spec"])[SIDECAR]
    assert build_parser().parse_args(sidecar["args"]).metrics_port is None
    assert [p["name"] for p in sidecar["ports"]] == ["colocar"]
    assert not any(k.startswith("prometheus.io/") for k in template["metadata"]["annotations"])
    base = dict(topology="v5e-16", image="a/b:1", bucket="gs://bucket")
    for kwargs, message in (
        (dict(metrics_port=7070), "is the sidecar's --port too"),
        (dict(metrics_port=80), "choose an unprivileged port"),
        (dict(metrics_port=0, pod_monitoring=True), "--pod-monitoring needs the metrics endpoint"),
    ):
        with pytest.raises(RenderError, match=message):
            build_options(**base, **kwargs)  # type: ignore[arg-type]


def test_sidecar_help_states_the_metrics_default() -> None:
    text = " ".join(build_parser().format_help().split())  # as wrapped for the terminal
    assert "--metrics-port" in text and "default: no metrics endpoint" in text
