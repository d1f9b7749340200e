"""The step directories of Orbax's layout, answering what `checkpoint.store.steps.StepDirs` answers
for colocar's format (controller, sidecar writer and `colocar ckpt`; no JAX).

A step is finished when Orbax would read it: on local disk, a `<N>` directory (no temporary
suffix: the rename is the commit); on GCS, `<N>/commit_success.txt`. colocar's steps say which
save attempt committed them in `_METADATA` (`custom_metadata.colocar`); a step Orbax wrote
itself has no attempt and gets its manifest from `foreign`. See `names` for the tree.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from colocar.checkpoint.format import layout
from colocar.checkpoint.store.steps import StepDirs

from . import names


class OrbaxSteps(StepDirs):
    """The `<N>` (and `<N>.orbax-checkpoint-tmp…`) directories of one storage root."""

    layout = "orbax"

    def __init__(self, storage: Any, item: str = names.ITEM):
        super().__init__(storage)
        self.item = item
        self.in_place = not storage.can_rename  # GCS: written where it stays, finished by a marker

    # --- names ----------------------------------------------------------------------------------
    def _dirs(self) -> dict[int, str]:
        """Finished-looking step directories by step (`<N>` or `<prefix>_<N>`)."""
        found: dict[int, str] = {}
        for name in self.storage.children():
            parsed = names.parse_step_name(name)
            if parsed is not None and not parsed[1]:
                found.setdefault(parsed[0], name)
        return found

    def step_dir(self, step: int) -> str:
        return self._dirs().get(step, str(step))

    def work_dir(self, step: int, attempt: str) -> str:
        """Where save `attempt` writes the step's files (renamed to `<N>` at commit on local disk)."""
        return str(step) if self.in_place else names.tmp_name(step, attempt)

    def child_db(self, step: int, attempt: str, host: int) -> str:
        """Host `host`'s own OCDBT database of save `attempt` (merged into the root at commit)."""
        item = f"{self.work_dir(step, attempt)}/{self.item}"
        inner = f"{names.ATTEMPT_PREFIX}{attempt}/" if self.in_place else ""
        return f"{item}/{inner}{names.PROCESS_PREFIX}{host}"

    def _in(self, step: int, attempt: str, entry: str) -> str:
        return f"{self.work_dir(step, attempt)}/{names.COLOCAR}/{names.ATTEMPT_PREFIX}{attempt}/{entry}"

    def _name(self, step: int, entry: str) -> str:
        return f"{self.step_dir(step)}/{entry}"

    def heartbeat_name(self, step: int, attempt: str) -> str:
        return self._in(step, attempt, layout.HEARTBEAT)

    # --- listing --------------------------------------------------------------------------------
    def all(self) -> list[int]:
        parsed = (names.parse_step_name(n) for n in self.storage.children())
        return sorted({p[0] for p in parsed if p is not None})

    def is_committed(self, step: int) -> bool:
        directory = self._dirs().get(step)
        return directory is not None and self._finished(directory)

    def committed(self, steps: list[int] | None = None) -> list[int]:
        dirs = self._dirs()  # one listing for all of them
        wanted = sorted(dirs) if steps is None else steps
        return [s for s in wanted if s in dirs and self._finished(dirs[s])]

    def _finished(self, directory: str) -> bool:
        if self.in_place:
            return self.storage.exists(f"{directory}/{names.COMMIT_SUCCESS}")
        return bool(self.storage.children(directory))

    def item_dir(self, step: int) -> str:
        return self._item_in(self.step_dir(step))

    def _item_in(self, directory: str) -> str:
        """The item of a finished step directory: `default` (ocp.CheckpointManager's one item),
        `state` (v1's), or its only item; `directory` itself for a StandardCheckpointer's."""
        prefix = f"{directory}/" if directory else ""
        if self.storage.exists(f"{prefix}{names.METADATA}"):
            return directory
        candidates = [self.item, names.V1_ITEM]
        try:
            handlers = json.loads(self.storage.read(f"{prefix}{names.CHECKPOINT_METADATA}") or b"{}")
            candidates += sorted(handlers.get("item_handlers") or {})
        except (ValueError, AttributeError):
            pass
        for item in candidates:
            if self.storage.exists(f"{prefix}{item}/{names.METADATA}"):
                return f"{prefix}{item}"
        return f"{prefix}{self.item}"

    def single_item(self) -> str | None:
        """The item dir when the root itself is one checkpoint (a StandardCheckpointer's
        directory, v1's `save_pytree`, or a step directory), else None."""
        if not (self.storage.exists(names.METADATA) or self.storage.exists(names.CHECKPOINT_METADATA)):
            return None
        return self._item_in("")

    def _metadata_at(self, item_dir: str) -> dict[str, Any] | None:
        prefix = f"{item_dir}/" if item_dir else ""
        try:
            body = json.loads(self.storage.read(f"{prefix}{names.METADATA}") or b"null")
        except ValueError:
            return None
        return body if isinstance(body, dict) else None

    def item_metadata(self, step: int) -> dict[str, Any] | None:
        return self._metadata_at(self.item_dir(step))

    def committed_attempt(self, step: int) -> str | None:
        if not self.is_committed(step):
            return None
        ours = ((self.item_metadata(step) or {}).get("custom_metadata") or {}).get(names.COLOCAR)
        return str(ours["attempt"]) if isinstance(ours, dict) and ours.get("attempt") else None

    def is_committed_by(self, step: int, attempt: str) -> bool:
        return self.committed_attempt(step) == attempt

    def attempts(self, step: int) -> list[str]:
        found = set()
        if self.in_place:
            for where in (f"{step}/{names.COLOCAR}", f"{step}/{self.item}"):
                found |= {layout.parse_attempt_dir(n) for n in self.storage.children(where)}
        else:
            found = {names.attempt_of_tmp(n) for n in self.storage.children() if n.startswith(f"{step}.")}
        committed = self.committed_attempt(step)
        return sorted(a for a in found | {committed} if a)

    def manifest(self, step: int) -> bytes | None:
        if not self.is_committed(step):
            ages = [(self.storage.age(self._manifest(step, a)), a) for a in self.attempts(step)]
            alive = sorted((age, a) for age, a in ages if age is not None)
            return self.storage.read(self._manifest(step, alive[0][1])) if alive else None
        return self.manifest_at(self.item_dir(step), step)

    def manifest_at(self, item_dir: str, step: int | None) -> bytes | None:
        """The manifest of the finished item at `item_dir`: colocar's own (in `_METADATA`'s
        custom metadata), or made from what Orbax wrote (`foreign`)."""
        metadata = self._metadata_at(item_dir)
        if metadata is None:
            return self.storage.read(f"{item_dir}/{names.METADATA}")  # unreadable: the caller says why
        ours = (metadata.get("custom_metadata") or {}).get(names.COLOCAR)
        if not isinstance(ours, dict):
            from . import foreign

            ours = foreign.manifest(self.storage, step, item_dir, metadata)
        ours["orbax"] = {**ours.get("orbax", {}), "item_dir": item_dir}
        return json.dumps(ours).encode()

    def age(self, step: int) -> float | None:
        ages = [self.storage.age(self.heartbeat_name(step, a)) for a in self.attempts(step)]
        ages += [self.storage.age(self._manifest(step, a)) for a in self.attempts(step)]
        known = [a for a in ages if a is not None]
        return min(known) if known else None

    def _unreadable(self, step: int, why: str) -> str:
        name = f"{self.storage.url}/{self.item_dir(step)}/{names.METADATA}"
        return f"step {step}: its metadata {name} is unreadable ({why})"

    # --- arrays ---------------------------------------------------------------------------------
    def arrays_root(self, step: int, manifest: dict[str, Any]) -> str:
        return str(manifest.get("orbax", {}).get("item_dir") or f"{self.step_dir(step)}/{self.item}")

    def write_spec(self, step: int, attempt: str, host: int, entry: dict[str, Any]) -> dict[str, Any]:
        kvstore = ocdbt_kvstore(self.storage.kvstore(self.child_db(step, attempt, host)), entry["dir"])
        kvstore.update(config=names.OCDBT_CONFIG, assume_config=True)
        return layout.entry_spec(kvstore, entry)

    def read_spec(self, step: int, manifest: dict[str, Any], entry: dict[str, Any]) -> dict[str, Any]:
        options = manifest["orbax"]
        item = options["item_dir"]
        if options.get("use_ocdbt", True):
            kvstore = ocdbt_kvstore(self.storage.kvstore(item), entry["dir"])
        else:
            kvstore = self.storage.kvstore(f"{item}/{entry['dir']}")
        return {
            "driver": "zarr3" if options.get("use_zarr3", True) else "zarr",
            "kvstore": kvstore,
            # Orbax itself reads a missing chunk as the fill value unless the step says every chunk is stored
            "fill_missing_data_reads": not options.get("store_array_data_equal_to_fill_value", True),
        }

    # --- writing and deleting -------------------------------------------------------------------
    def commit(self, step: int, attempt: str, hosts: list[int]) -> bool:
        from . import commit

        return commit.commit(self, step, attempt, hosts)

    def delete(self, step: int) -> None:
        """Never half-restorable: on local disk the step is renamed to a temporary name first,
        on GCS its `commit_success.txt` goes first."""
        directory = self.step_dir(step)
        if self.in_place:
            self.storage.delete(f"{directory}/{names.COMMIT_SUCCESS}")
            self.storage.delete_tree(directory)
            return
        doomed = names.tmp_name(step, f"deleted-{uuid.uuid4().hex[:8]}")
        if self.storage.rename(directory, doomed):
            self.storage.delete_tree(doomed)

    def clear_failed_save(self, step: int) -> None:
        """Nothing to do: every save writes its own attempt's directories."""

    def clear_other_attempts(self, step: int, attempt: str) -> None:
        for other in self.attempts(step):
            if other == attempt:
                continue
            try:
                if self.in_place:
                    self.storage.delete_tree(f"{step}/{names.COLOCAR}/{names.ATTEMPT_PREFIX}{other}")
                    self.storage.delete_tree(f"{step}/{self.item}/{names.ATTEMPT_PREFIX}{other}")
                else:
                    self.storage.delete_tree(names.tmp_name(step, other))
            except Exception:
                pass

    def remove_debris(self, step: int) -> None:
        if self.in_place:
            self.storage.delete_tree(str(step))
            return
        for name in self.storage.children():
            parsed = names.parse_step_name(name)
            if parsed == (step, True):
                self.storage.delete_tree(name)


def ocdbt_kvstore(base: dict[str, Any], path: str) -> dict[str, Any]:
    """The kvstore of one array (`path`) in the OCDBT database at `base`."""
    return {"driver": "ocdbt", "base": base, "path": path}
