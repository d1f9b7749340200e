"""The `colocar` command: `sidecar`, `bench`, `ckpt` (list/inspect checkpoints), `k8s` (render manifests)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: colocar {sidecar,bench,ckpt,k8s} ...\n")
        print("  sidecar   run a sidecar (colocar sidecar --help)")
        print("  bench     run a benchmark: colocar bench {rpc,transfer,loader,ckpt} [--json] [--quick]")
        print("  ckpt      list and inspect checkpoints: colocar ckpt {ls PATH,show PATH STEP}")
        print("  k8s       render Kubernetes manifests: colocar k8s render --topology T --image I --bucket B")
        sys.exit(0 if argv else 2)
    command, rest = argv[0], argv[1:]
    if command == "sidecar":
        from colocar.sidecar.server import main as sidecar_main

        sidecar_main(rest)
    elif command == "bench":
        from colocar.bench.run import main as bench_main

        bench_main(rest)
    elif command == "ckpt":
        from colocar.checkpoint.cli import main as ckpt_main

        ckpt_main(rest)
    elif command == "k8s":
        from colocar.k8s.cli import main as k8s_main

        k8s_main(rest)
    else:
        print(f"colocar: unknown command {command!r} (sidecar, bench, ckpt, k8s)", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
