"""`colocar k8s render|examples`: print a job's or a pool's manifests, or regenerate `k8s/examples/`.

`render` writes pure multi-document YAML on stdout and the setup commands (token Secret,
Workload Identity bindings) on stderr; `render --pool --tenants FILE` renders a shared pool
of sidecars that outlives jobs instead. Bad input exits 2 with a message on stderr and nothing
on stdout. `examples DIR` writes one file per topology and variant, from `EXAMPLE_ARGS`;
`examples --pool DIR` the pool's examples and their tenants file.
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
from .pool.options import PoolOptions, build_pool_options
from .pool.render import pool_commands, pool_header, render_pool
from .render import render, setup_commands, to_yaml
from .topologies import TOPOLOGIES

EXAMPLE_ARGS = [
    "--image", "us-docker.pkg.dev/my-project/colocar/train:0.1.0",
    "--bucket", "gs://my-bucket/colocar",
    "--gcp-service-account", "colocar@my-project.iam.gserviceaccount.com",
]  # fmt: skip
POOL_EXAMPLE_TOPOLOGIES = ("v5e-16", "a3-16")
EXAMPLE_POOL_ARGS = [
    "--image", "us-docker.pkg.dev/my-project/colocar/colocar:0.1.0",
    "--tenants", "k8s/examples/pool/tenants.yaml", "--capacity", "16G", "--no-secrets",
]  # fmt: skip
EXAMPLE_TENANTS = """\
# The example pool's tenants (k8s/examples/pool/*.yaml are rendered from this file). The
# format of `colocar pool up --tenants`; on Kubernetes every token_file becomes the tenant's
# Secret (so none is given here), and names are lowercase letters, digits and '-'.
tenants:
  research:
    priority: 10   # served first when both wait
    quotas: {arena: 8G, calls: 16, processes: 2, sessions: 4}
  batch:
    quotas: {arena: 4G, calls: 8, processes: 1, sessions: 2}
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="colocar k8s", description=__doc__, formatter_class=HelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser(
        "render", help="print the manifests of a job (YAML on stdout)", formatter_class=HelpFormatter
    )
    r.add_argument("--topology", required=True, help=f"one of: {', '.join(TOPOLOGIES)}")
    r.add_argument("--image", required=True, help="the colocar image (or yours built on it), with a tag")
    r.add_argument("--bucket", help="gs://BUCKET/PREFIX the job reads and writes (required but with --pool)")
    r.add_argument(
        "--name", help="JobSet or pool name, prefix of every object (default: train; with --pool: pool)"
    )
    r.add_argument("--variant", default=VARIANTS[0], help=f"{' or '.join(VARIANTS)} (default: {VARIANTS[0]})")
    r.add_argument("--trainer-image", help="the trainer's image (default: --image)")
    r.add_argument("--trainer-command", default=TRAINER_COMMAND, help="the per-host process")
    r.add_argument("--controller-command", default=CONTROLLER_COMMAND, help="single-controller only")
    r.add_argument("--gcp-service-account", default=DEFAULT_GSA, help="Google service account for GCS")
    r.add_argument("--namespace", default="default", help="in the printed commands (--pool: and the objects)")
    r.add_argument("--port", type=int, default=7070, help="sidecar port (default: 7070)")
    r.add_argument(
        "--shm-size", help="sizeLimit of the arena volume, e.g. 32G or 32Gi (default: per topology)"
    )
    r.add_argument(
        "--arena-pool",
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
        help="the sidecar's (--pool: the agent's) Prometheus port, named in prometheus.io pod annotations "
        "(default: 9464; 0: none)",
    )
    r.add_argument(
        "--pod-monitoring",
        action="store_true",
        help="also render a PodMonitoring for GKE's managed Prometheus (needs its CRD)",
    )
    _pool_arguments(r)
    e = sub.add_parser("examples", help="write k8s/examples-style files for every topology and variant")
    e.add_argument("--pool", action="store_true", help="the shared pool's examples (k8s/examples/pool)")
    e.add_argument("dir", type=Path)
    return p


def _pool_arguments(r: argparse.ArgumentParser) -> None:
    """The shared-pool mode's flags (`--pool`; `--port`, `--namespace` and others are shared)."""
    r.add_argument(
        "--pool",
        nargs="?",
        const=True,
        action="append",
        default=[],
        help="render a shared sidecar pool that outlives jobs (node pods, an agent), not a job; takes "
        "no value (NAME=SIZE was the old spelling of --arena-pool)",
    )
    r.add_argument("--tenants", help="--pool: the tenants file (YAML, as for colocar pool up)")
    r.add_argument("--capacity", help="--pool: arena bytes per host, all tenants together (default: 1G)")
    r.add_argument("--max-tenants", type=int, help="--pool: tenants served at once (default: 8)")
    r.add_argument(
        "--idle-seconds", type=float, help="--pool: a tenant without sessions this long stops (default: 60)"
    )
    r.add_argument(
        "--no-secrets",
        action="store_true",
        help="--pool: leave the Secrets (fresh tokens) out and print the commands that create them",
    )


def options_from_args(args: argparse.Namespace) -> RenderOptions:
    return build_options(
        topology=args.topology,
        image=args.image,
        bucket=args.bucket,
        name=args.name or "train",
        variant=args.variant,
        trainer_image=args.trainer_image,
        trainer_command=args.trainer_command,
        controller_command=args.controller_command,
        gcp_service_account=args.gcp_service_account,
        namespace=args.namespace,
        port=args.port,
        shm_size=args.shm_size,
        pools=args.arena_pool,
        sidecar_cpu=args.sidecar_cpu,
        sidecar_memory=args.sidecar_memory,
        tls_secret=args.tls_secret,
        max_restarts=args.max_restarts,
        metrics_port=args.metrics_port,
        pod_monitoring=args.pod_monitoring,
        trainer_restarts=args.trainer_restarts,
    )


JOB_ONLY = ("bucket", "variant", "trainer_image", "trainer_command", "controller_command",
            "gcp_service_account", "shm_size", "arena_pool", "tls_secret", "max_restarts",
            "trainer_restarts")  # fmt: skip
POOL_ONLY = ("tenants", "capacity", "max_tenants", "idle_seconds", "no_secrets")


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def parse_render(argv: list[str]) -> argparse.Namespace:
    """`render` arguments, checked for the mode they select (a job, or `--pool`)."""
    parser = build_parser()
    args = parser.parse_args(["render", *argv])
    for value in args.pool:
        if isinstance(value, str) and "=" in value:
            raise RenderError(
                f"--pool {value}: --pool now renders a shared sidecar pool; to reserve part of a "
                f"job's arena, write --arena-pool {value}"
            )
        if isinstance(value, str):
            raise RenderError(f"--pool takes no value (got {value!r}); the pool's tenants: --tenants FILE")
    args.pool = bool(args.pool)
    defaults = parser.parse_args(["render", "--topology", args.topology, "--image", args.image])
    given = [d for d in (JOB_ONLY if args.pool else POOL_ONLY) if getattr(args, d) != getattr(defaults, d)]
    if given:
        what = "a job's manifests, not to --pool" if args.pool else "--pool only"
        raise RenderError(f"{', '.join(_flag(d) for d in given)}: applies to {what}")
    if args.pool and not args.tenants:
        raise RenderError("--pool needs --tenants FILE: the pool's tenants (YAML, as for colocar pool up)")
    if not args.pool and not args.bucket:
        parser.error("the following arguments are required: --bucket (or, for a shared pool: --pool)")
    return args


def render_text(argv: list[str]) -> tuple[str, RenderOptions]:
    """A job's `render` arguments -> (the YAML it prints, the options); RenderError on bad input."""
    args = parse_render(argv)
    if args.pool:
        raise RenderError("render_text renders a job: use render_pool_text for --pool")
    opts = options_from_args(args)
    header = (
        f"{opts.topology.description}; {opts.variant}.\n"
        f"Generated by: colocar k8s render {shlex.join(argv)}\n"
        "Create the token Secret first (the command is printed on stderr)."
    )
    return to_yaml(render(opts), header), opts


def render_pool_text(argv: list[str], tenants_text: str | None = None) -> tuple[str, PoolOptions]:
    """`render --pool` arguments -> (the YAML it prints, the options); the tenants file is
    read from `--tenants` unless its `tenants_text` is given (the examples)."""
    args = parse_render(argv)
    opts = build_pool_options(
        topology=args.topology,
        image=args.image,
        tenants_file=args.tenants,
        tenants_text=tenants_text,
        name=args.name or "pool",
        namespace=args.namespace,
        port=args.port,
        capacity=args.capacity or "1G",
        max_tenants=8 if args.max_tenants is None else args.max_tenants,
        idle_seconds=60.0 if args.idle_seconds is None else args.idle_seconds,
        sidecar_cpu=args.sidecar_cpu,
        sidecar_memory=args.sidecar_memory,
        metrics_port=args.metrics_port,
        pod_monitoring=args.pod_monitoring,
        secrets=not args.no_secrets,
    )
    return to_yaml(render_pool(opts), pool_header(opts, shlex.join(argv))), opts


def pool_example_files() -> dict[str, str]:
    """File name -> content of every committed pool example (k8s/examples/pool), with the
    tenants file they are rendered from; no Secrets (`--no-secrets`), so no tokens."""
    files = {"tenants.yaml": EXAMPLE_TENANTS}
    for topology in POOL_EXAMPLE_TOPOLOGIES:
        argv = ["--pool", "--topology", topology, *EXAMPLE_POOL_ARGS]
        files[f"{topology}.yaml"] = render_pool_text(argv, tenants_text=EXAMPLE_TENANTS)[0]
    return files


def example_files() -> dict[str, str]:
    """File name -> content of every committed example."""
    files = {}
    for topology in TOPOLOGIES:
        for variant in VARIANTS:
            argv = ["--topology", topology, "--variant", variant, *EXAMPLE_ARGS]
            files[f"{topology}.{variant}.yaml"] = render_text(argv)[0]
    return files


def _render(argv: list[str]) -> tuple[str, list[str]]:
    """(stdout, the lines for stderr) of `render`, for a job or a pool."""
    if parse_render(argv).pool:
        text, pool_opts = render_pool_text(argv)
        return text, pool_commands(pool_opts)
    text, opts = render_text(argv)
    return text, setup_commands(opts)


def main(argv: list[str]) -> None:
    parser = build_parser()
    if not argv or argv[0] not in ("render", "examples"):
        parser.parse_args(argv)  # usage or --help; exits
    try:
        if argv[0] == "render":
            text, lines = _render(argv[1:])
            sys.stdout.write(text)
            sys.stdout.flush()
            print("\n".join(lines), file=sys.stderr)
        else:
            args = parser.parse_args(argv)
            out = args.dir
            out.mkdir(parents=True, exist_ok=True)
            for name, text in (pool_example_files() if args.pool else example_files()).items():
                (out / name).write_text(text)
                print(f"wrote {out / name}", file=sys.stderr)
    except RenderError as e:
        print(f"colocar k8s {argv[0]}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main(sys.argv[1:])
