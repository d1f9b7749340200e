"""A shared pool for the tests: its tenants file and token files, `colocar pool up` and `down`.

The pool is real: its agent process started by `colocar pool up`, each tenant's sidecars
started by the agent, controllers joining with `colocar.connect(pool=...)`.
"""

from __future__ import annotations

import argparse
import os

import yaml

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
        defaults = {"hosts": 2, "capacity": "64M", "max_tenants": 8, "idle_seconds": 60, "metrics_port": None}
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
        from colocar.pool import client

        token = self.token(as_tenant) if as_tenant else self.admin_token()
        return client.pool_status(self.pool_file, token)

    def admin_token(self) -> str:
        with open(self.record["admin_token_file"]) as f:
            return f.read().strip()
