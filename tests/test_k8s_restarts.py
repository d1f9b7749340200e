"""`colocar k8s render --trainer-restarts N`: a failed trainer container restarts in place while
its pod, native sidecar and arena volume (the snapshots in it) stay; validated offline like the
other manifests (kubernetes-validate's 1.33 schemas, the JobSet CRD copy in tests/data/schemas).
"""

from __future__ import annotations

from typing import Any

import jsonschema
import kubernetes_validate
import pytest
from k8s_helpers import (
    K8S_VERSION,
    containers_of,
    env_of,
    load_jobset_schema,
    of_kind,
    pod_templates,
    render_case,
)

from colocar.k8s import TOPOLOGIES
from colocar.k8s.cli import main
from colocar.k8s.pod import SIDECAR, TRAINER


@pytest.fixture(scope="module")
def jobset_schema() -> dict[str, Any]:
    return load_jobset_schema()


@pytest.mark.parametrize("topology", list(TOPOLOGIES))
def test_trainer_restarts_in_place_keeping_pod_sidecar_and_arena(topology: str, jobset_schema) -> None:
    objects = render_case(topology, "multi-controller", "--trainer-restarts", "2")
    (jobset,) = of_kind(objects, "JobSet")
    jsonschema.validators.validator_for(jobset_schema)(jobset_schema).validate(jobset)
    job = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
    hosts = TOPOLOGIES[topology].hosts
    assert job["backoffLimit"] == 2 * hosts  # every host's trainer may restart twice (together)
    spec = pod_templates(jobset)["workers"]["spec"]
    assert spec["restartPolicy"] == "OnFailure"  # the trainer container restarts in the same pod
    containers = containers_of(spec)
    assert containers[SIDECAR]["restartPolicy"] == "Always"  # the native sidecar keeps running
    assert {"medium": "Memory"}.items() <= next(
        v["emptyDir"] for v in spec["volumes"] if v["name"] == "colocar-shm"
    ).items()  # the arena is the pod's volume: it lives as long as the pod
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "w-0"}, "spec": spec}
    assert kubernetes_validate.validate(pod, K8S_VERSION, strict=True) == K8S_VERSION
    if hosts > 1:  # the peers reach this host's sidecar by the pod's DNS name
        assert env_of(containers[TRAINER])["COLOCAR_PEER_ADDRESS"] == "{hostname}.train:7070"


def test_without_trainer_restarts_a_failure_fails_the_slice() -> None:
    (jobset,) = of_kind(render_case("v5e-16", "multi-controller"), "JobSet")
    assert jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["backoffLimit"] == 0
    assert pod_templates(jobset)["workers"]["spec"]["restartPolicy"] == "Never"


@pytest.mark.parametrize(
    "change,message",
    [
        (["--trainer-restarts", "-1"], "--trainer-restarts -1 must be 0 or more"),
        (["--trainer-restarts", "2", "--variant", "single-controller"], "use --variant multi-controller"),
    ],
)
def test_bad_trainer_restarts_are_refused(change: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["render", "--topology", "v5e-16", "--image", "i:1", "--bucket", "gs://my-bucket/x", *change])
    out, err = capsys.readouterr()
    assert exc.value.code == 2 and out == "" and message in err
