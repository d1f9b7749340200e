"""The demo's training on your own cluster: `colocar.demo.train.train`, unchanged, against real
sidecars (`colocar.connect()`) and a real bucket. `make demo` runs the same function on a local
cluster with a fake GCS server, and kills a host midway (`colocar demo --help`).

    colocar demo --quick --out demo-out               # writes demo-out/data/pipeline.yaml + shards
    COLOCAR_SIDECARS=h0:7070,h1:7070 COLOCAR_TOKEN_FILE=token \\
        python examples/demo.py --config demo-out/data/pipeline.yaml --storage gs://BUCKET/digits
    python examples/demo.py --local 4 --config demo-out/data/pipeline.yaml --storage /tmp/digits

The pipeline's shards must be readable at the same path on every sidecar host (copy them there,
or a shared file system). One controller drives every host's devices (README "Elastic training").
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # CPU-only runs

import colocar  # noqa: E402
from colocar.demo import data, train  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="the pipeline config (colocar demo writes one)")
    parser.add_argument("--storage", required=True, help="checkpoints: gs://BUCKET/PATH or a directory")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--local", type=int, default=0, help="start N local sidecars instead of connecting")
    args = parser.parse_args()
    cluster = colocar.local_cluster(hosts=args.local) if args.local else colocar.connect()
    with cluster:
        settings = train.Settings(config=args.config, storage=args.storage, steps=args.steps)
        params, elastic = train.train(cluster, settings)
    images, labels = data.read_test(os.path.dirname(os.path.abspath(args.config)))
    counts, hosts = elastic.stats()["counts"], elastic.stats()["hosts"]
    accuracy = train.accuracy(params, images, labels)
    print(
        f"demo.py: {args.steps} steps on {len(hosts)} hosts, {counts['snapshot']} snapshots, "
        f"{counts['save']} saves in {args.storage}, test accuracy {accuracy:.3f}"
    )


if __name__ == "__main__":
    main()
