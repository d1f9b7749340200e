"""A shared pool for the tests: its tenants file and token files, `colocar pool up` and `down`.

The pool is real: its agent process started by `colocar pool up`, each tenant's sidecars
started by the agent, controllers joining with `colocar.connect(pool=...)`.
"""

from __future__ import annotations

import argparse
import os
import sys

import yaml

from colocar.controller_bridge.local.sidecars import Sidecar, wait_ready
from colocar.pool import cli
from colocar.protocol.tokens import new_token, write_token_file

MiB = 1 << 20


class LivePool:
    """A pool in `folder` with `tenants` (name -> entry without token_file: one is made)."""

    def __init__(self, folder: str, shm_dir: str, tenants: dict[str, dict], **flags: object):
        self.folder, self.shm_dir = folder, shm_dir
        os.makedirs(folder, exist_ok=True)
        self.entries = {}
        for name, entry in tenants.items():
            self.entries[name] = {"token_file": f"{name}.token", **entry}
            write_token_file(self.token_file(name), new_token())
        self.tenants_file = os.path.join(folder, "tenants.yaml")
        self.write_tenants()
        defaults = {
            "hosts": 2, "capacity": "64M", "max_tenants": 8, "idle_seconds": 60, "metrics_port": None,
            "nodes": None, "node_token_file": None,
        }  # fmt: skip
        self.flags = {**defaults, **flags}
        self.pool_file = os.path.join(folder, "pool", "pool.json")
        self.record: dict = {}

    def token_file(self, name: str) -> str:
        return os.path.join(self.folder, f"{name}.token")

    def token(self, name: str) -> str:
        with open(self.token_file(name)) as f:
            return f.read().strip()

    def write_tenants(self) -> None:
        fresh = self.tenants_file + ".new"
        with open(fresh, "w") as f:
            yaml.safe_dump({"tenants": self.entries}, f)
        os.replace(fresh, self.tenants_file)

    def rotate(self, name: str) -> str:
        """A new token for `name` (written whole, as an operator's tool would); returns it."""
        token, fresh = new_token(), self.token_file(name) + ".new"
        write_token_file(fresh, token)
        os.replace(fresh, self.token_file(name))
        return token

    def up(self) -> LivePool:
        args = argparse.Namespace(
            tenants=self.tenants_file,
            dir=os.path.dirname(self.pool_file),
            lease_seconds=3.0,
            address="127.0.0.1:0",
            shm_dir=self.shm_dir,
            **self.flags,
        )
        self.record = cli.up(args)
        return self

    def down(self) -> None:
        if os.path.exists(self.pool_file):
            cli.down(argparse.Namespace(pool=self.pool_file, token_file=None))

    def status(self, as_tenant: str | None = None) -> dict:
        from colocar.controller_bridge import pool_client as client

        token = self.token(as_tenant) if as_tenant else self.admin_token()
        return client.pool_status(self.pool_file, token)

    def admin_token(self) -> str:
        with open(self.record["admin_token_file"]) as f:
            return f.read().strip()


class LiveNodes:
    """`colocar pool node` processes on this machine, each standing for a machine of its own:
    its own folder, arena folder and (given `machines`) machine name."""

    def __init__(
        self, folder: str, shm_dir: str, count: int, machines: list[str] | None = None, **flags: object
    ):
        self.folder, self.shm_dir = folder, shm_dir
        os.makedirs(folder, exist_ok=True)
        self.token_file = os.path.join(folder, "node.token")
        write_token_file(self.token_file, new_token())
        self.machines = machines or []
        self.flags = [f"--{k.replace('_', '-')}={v}" for k, v in flags.items()]
        self.nodes = [Sidecar(i, folder, label=f"node{i}") for i in range(count)]

    def up(self) -> LiveNodes:
        try:
            for i, node in enumerate(self.nodes):
                env = dict(os.environ)
                if self.machines:
                    env["COLOCAR_NODE_NAME"] = self.machines[i]
                workdir = os.path.join(self.folder, f"node{i}")
                argv = [
                    sys.executable, "-m", "colocar.pool.node_main", "--token-file", self.token_file,
                    "--shm-dir", self.shm_dir, "--workdir", workdir, *self.flags,
                ]  # fmt: skip
                node.spawn(argv, env)
            wait_ready(self.nodes, 120.0)
        except BaseException:
            self.down()
            raise
        return self

    @property
    def addresses(self) -> str:
        return ",".join(str((n.info or {})["address"]) for n in self.nodes)

    def pid(self, i: int) -> int:
        return self.nodes[i].process.pid

    def down(self) -> None:
        for node in self.nodes:
            if getattr(node, "process", None) is not None:
                node.stop(30.0)
