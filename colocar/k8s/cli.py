"""`colocar k8s render|examples`: print a job's manifests, or regenerate `k8s/examples/`.

`render` writes pure multi-document YAML on stdout and the setup commands (token Secret,
Workload Identity bindings) on stderr. Bad input exits 2 with a message on stderr and nothing
on stdout. `examples DIR` writes one file per topology and variant, from `EXAMPLE_ARGS`.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from colocar.cli_help import HelpFormatter

from .options import (
    CONTROLLER_COMMAND,
    DEFAULT_GSA,
    TRAINER_COMMAND,
    VARIANTS,
    RenderError,
    RenderOptions,
    build_options,
)
from .render import render, setup_commands, to_yaml
from .topologies import TOPOLOGIES

EXAMPLE_ARGS = [
    "--image", "us-docker.pkg.dev/my-project/colocar/train:0.1.0",
    "--bucket", "gs://my-bucket/colocar",
    "--gcp-service-account", "colocar@my-project.iam.gserviceaccount.com",
]  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="colocar k8s", description=__doc__, formatter_class=HelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser(
        "render", help="print the manifests of a job (YAML on stdout)", formatter_class=HelpFormatter
    )
    r.add_argument("--topology", required=True, help=f"one of: {', '.join(TOPOLOGIES)}")
    r.add_argument("--image", required=True, help="the colocar image (or yours built on it), with a tag")
    r.add_argument("--bucket", required=True, help="gs://BUCKET/PREFIX the job reads and writes")
    r.add_argument("--name", default="train", help="JobSet name, prefix of every object (default: train)")
    r.add_argument("--variant", default=VARIANTS[0], help=f"{' or '.join(VARIANTS)} (default: {VARIANTS[0]})")
    r.add_argument("--trainer-image", help="the trainer's image (default: --image)")
    r.add_argument("--trainer-command", default=TRAINER_COMMAND, help="the per-host process")
    r.add_argument("--controller-command", default=CONTROLLER_COMMAND, help="single-controller only")
    r.add_argument("--gcp-service-account", default=DEFAULT_GSA, help="Google service account for GCS")
    r.add_argument("--namespace", default="default", help="used in the printed setup commands only")
    r.add_argument("--port", type=int, default=7070, help="sidecar port (default: 7070)")
    r.add_argument(
        "--shm-size", help="sizeLimit of the arena volume, e.g. 32G or 32Gi (default: per topology)"
    )
    r.add_argument(
        "--pool",
        action="append",
        default=[],
        help="reserve NAME=SIZE of the arena, e.g. ckpt=8G (repeatable)",
    )
    r.add_argument("--sidecar-cpu", type=int, help="sidecar cores (default: per topology)")
    r.add_argument(
        "--sidecar-memory", help="sidecar memory beyond the arena, e.g. 8G or 8Gi (default: per topology)"
    )
    r.add_argument("--tls-secret", help="Secret with tls.crt, tls.key, ca.crt: mutual TLS to the sidecar")
    r.add_argument("--max-restarts", type=int, default=3, help="JobSet restarts before it fails (default: 3)")
    r.add_argument(
        "--trainer-restarts",
        type=int,
        default=0,
        help="multi-controller: restart a failed trainer container in place up to N times per host, "
        "keeping its pod, sidecar and arena (resume from snapshots in RAM); default: 0",
    )
    r.add_argument(
        "--metrics-port",
        type=int,
        default=9464,
        help="the sidecar's Prometheus port, named in prometheus.io pod annotations (default: 9464; 0: none)",
    )
    r.add_argument(
        "--pod-monitoring",
        action="store_true",
        help="also render a PodMonitoring for GKE's managed Prometheus (needs its CRD)",
    )
    e = sub.add_parser("examples", help="write k8s/examples-style files for every topology and variant")
    e.add_argument("dir", type=Path)
    return p


def options_from_args(args: argparse.Namespace) -> RenderOptions:
    return build_options(
        topology=args.topology,
        image=args.image,
        bucket=args.bucket,
        name=args.name,
        variant=args.variant,
        trainer_image=args.trainer_image,
        trainer_command=args.trainer_command,
        controller_command=args.controller_command,
        gcp_service_account=args.gcp_service_account,
        namespace=args.namespace,
        port=args.port,
        shm_size=args.shm_size,
        pools=args.pool,
        sidecar_cpu=args.sidecar_cpu,
        sidecar_memory=args.sidecar_memory,
        tls_secret=args.tls_secret,
        max_restarts=args.max_restarts,
        metrics_port=args.metrics_port,
        pod_monitoring=args.pod_monitoring,
        trainer_restarts=args.trainer_restarts,
    )


def render_text(argv: list[str]) -> tuple[str, RenderOptions]:
    """`render` arguments -> (the YAML it prints, the options); RenderError on bad input."""
    args = build_parser().parse_args(["render", *argv])
    opts = options_from_args(args)
    header = (
        f"{opts.topology.description}; {opts.variant}.\n"
        f"Generated by: colocar k8s render {shlex.join(argv)}\n"
        "Create the token Secret first (the command is printed on stderr)."
    )
    return to_yaml(render(opts), header), opts


def example_files() -> dict[str, str]:
    """File name -> content of every committed example."""
    files = {}
    for topology in TOPOLOGIES:
        for variant in VARIANTS:
            argv = ["--topology", topology, "--variant", variant, *EXAMPLE_ARGS]
            files[f"{topology}.{variant}.yaml"] = render_text(argv)[0]
    return files


def main(argv: list[str]) -> None:
    parser = build_parser()
    if not argv or argv[0] not in ("render", "examples"):
        parser.parse_args(argv)  # usage or --help; exits
    try:
        if argv[0] == "render":
            text, opts = render_text(argv[1:])
            sys.stdout.write(text)
            sys.stdout.flush()
            print("\n".join(setup_commands(opts)), file=sys.stderr)
        else:
            out = parser.parse_args(argv).dir
            out.mkdir(parents=True, exist_ok=True)
            for name, text in example_files().items():
                (out / name).write_text(text)
                print(f"wrote {out / name}", file=sys.stderr)
    except RenderError as e:
        print(f"colocar k8s {argv[0]}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main(sys.argv[1:])
