"""Orbax checkpoints both ways, against the real orbax-checkpoint: colocar writes Orbax's layout
(`layout="orbax"`) and Orbax restores it in a process that never imports colocar
(tests/programs/orbax_peer.py), with its v0 `CheckpointManager` and its v1 `load_pytree`; colocar
restores what Orbax wrote (OCDBT or one directory per array, zarr v2 or zarr3, a
CheckpointManager's steps, a StandardCheckpointer's directory, v1's), onto another mesh, bit for
bit; an unfinished Orbax step is never restored; a job moves from Orbax to colocar and back.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys

import orbax_states
import pytest
from checkpoint_helpers import MiB, make_state
from helpers import program
from multi_helpers import run_two

from colocar.checkpoint import CheckpointError, CheckpointManager
from colocar.checkpoint.orbax import names

ORBAX_WAYS = ["ocdbt", "zarr3", "per-array", "standard", "v1"]


def peer(*args: str, env: dict | None = None) -> list[str]:
    """Runs the Orbax peer to its end; its output lines (it must succeed)."""
    run = subprocess.run(
        [sys.executable, program("orbax_peer"), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, **(env or {})},
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    return run.stdout.splitlines()


@pytest.fixture(scope="module")
def orbax_written(tmp_path_factory):
    """Every way Orbax writes `orbax_states.state(7)` (see orbax_peer.py `save`)."""
    base = tmp_path_factory.mktemp("orbax-written")
    assert peer("save", base, 7) == ["saved"]
    return base


@pytest.mark.parametrize("way", ORBAX_WAYS)
def test_colocar_restores_what_orbax_wrote(cluster, orbax_written, way):
    m = CheckpointManager(str(orbax_written / way), cluster)
    try:
        assert m.all_steps() == ([] if way in ("standard", "v1") else [1])
        restored = m.restore(None, orbax_states.target(7))
        assert orbax_states.mismatches(restored, 7) == []
        needed = m.stats()["restore"]["bytes_needed"]  # each host read only its devices' slices
        assert sorted(needed) == [0, 1] and all(0 < n < 2 * 64 * 32 * 4 for n in needed.values())
        saved = m.restore()  # no target: Orbax's own shardings (_sharding), plain containers
        assert (
            saved["params"]["dense"]["kernel"].sharding.spec == orbax_states.SAVE_SPECS["params.dense.kernel"]
        )
        assert saved["step"] == 7 and saved["lr"] == 0.25
    finally:
        m.close()


def test_orbax_restores_what_colocar_wrote(cluster, tmp_path):
    directory = tmp_path / "colocar-wrote"
    with CheckpointManager(str(directory), cluster, layout="orbax", max_chunk_bytes=8 * 1024) as m:
        m.save(5, orbax_states.state(5), metadata={"run": "a"})
        m.wait()
        assert m.all_steps() == [5] and m.metadata(5) == {"run": "a"}
        assert orbax_states.mismatches(m.restore(5, orbax_states.target(5)), 5) == []
    step = directory / "5"
    assert sorted(os.listdir(step)) == [names.CHECKPOINT_METADATA, names.COMMIT_SUCCESS, names.ITEM]
    item = set(os.listdir(step / names.ITEM))
    assert {names.METADATA, names.SHARDING, names.ARRAY_METADATAS, names.MANIFEST_OCDBT, "d"} <= item
    assert {"ocdbt.process_0", "ocdbt.process_1"} <= item  # one database per writing host
    metadata = json.loads((step / names.ITEM / names.METADATA).read_text())
    assert metadata["store_array_data_equal_to_fill_value"] is True  # else Orbax reads a lost chunk as 0
    assert peer("restore", directory, 5, 5) == ["restored"]


def test_v1_training_checkpointer_restores_the_state_item(cluster, tmp_path):
    """`item="state"`: the item v1's `training.Checkpointer` loads by default; colocar lists
    and restores it too, and an item name Orbax's layout cannot hold is refused up front."""
    directory = tmp_path / "v1-training"
    with CheckpointManager(str(directory), cluster, layout="orbax", item=names.V1_ITEM) as m:
        m.save(3, orbax_states.state(3))
        m.wait()
    wrote = sorted(os.listdir(directory / "3"))
    assert wrote == [names.CHECKPOINT_METADATA, names.COMMIT_SUCCESS, names.V1_ITEM]
    with CheckpointManager(str(directory), cluster) as reader:
        assert reader.all_steps() == [3]
        assert orbax_states.mismatches(reader.restore(3, orbax_states.target(3)), 3) == []
    assert peer("restore-training", directory, 3, 3) == ["restored"]
    for bad, layout in (("state", "colocar"), ("colocar", "orbax"), ("a/b", "orbax"), ("7", "orbax")):
        with pytest.raises(ValueError, match="item"):
            CheckpointManager(str(tmp_path / "refused"), cluster, layout=layout, item=bad)


def test_colocars_extras_ride_along_where_orbax_ignores_them(cluster, tmp_path):
    """Strings, None and lists of numbers (a data iterator's state) restore through colocar;
    Orbax restores the arrays and numbers and ignores the rest."""
    state = make_state(4)
    state["none"] = None
    with CheckpointManager(str(tmp_path / "extras"), cluster, layout="orbax") as m:
        m.save(1, state)
        m.wait()
        restored = m.restore()
    assert restored["data"] == {"epoch": 1, "positions": [3, 5], "source": "train"}
    assert restored["none"] is None and restored["step"] == 4
    metadata = json.loads((tmp_path / "extras" / "1" / names.ITEM / names.METADATA).read_text())
    assert "('data', 'source')" not in metadata["tree_metadata"]  # not a value Orbax's tree holds
    assert "('data', 'positions', '1')" in metadata["tree_metadata"]


def test_an_unfinished_orbax_step_is_never_restored(cluster, orbax_written, tmp_path):
    """A step as Orbax leaves it before its commit (its temporary name) is neither listed nor
    restored, and the error names it."""
    directory = tmp_path / "unfinished"
    shutil.copytree(orbax_written / "ocdbt", directory)
    os.rename(directory / "1", directory / f"2{names.TMP_SUFFIX}")
    shutil.copytree(orbax_written / "ocdbt" / "1", directory / "1")
    with CheckpointManager(str(directory), cluster) as m:
        assert m.all_steps() == [1]
        with pytest.raises(CheckpointError, match=r"step 2 is not a committed checkpoint.*unfinished.*\[2\]"):
            m.restore(2, orbax_states.target(7))
        shutil.rmtree(directory / "1")
        with pytest.raises(
            CheckpointError, match=r"no committed checkpoint.*unfinished, never restored: steps \[2\]"
        ):
            m.restore(None, orbax_states.target(7))


def test_a_job_moves_from_orbax_to_colocar_and_back(cluster, orbax_written, tmp_path):
    """An Orbax job's directory: colocar continues from its latest step (in Orbax's layout),
    then an Orbax job continues from colocar's step; every step restores bit for bit."""
    directory = tmp_path / "moving"
    shutil.copytree(orbax_written / "ocdbt", directory)  # Orbax trained to step 1
    with CheckpointManager(str(directory), cluster, layout="orbax") as m:
        assert orbax_states.mismatches(m.restore(m.latest_step(), orbax_states.target(7)), 7) == []
        m.save(2, orbax_states.state(8))
        m.wait()
    assert peer("continue", directory, 9) == ["continued 3"]  # Orbax restored step 2, saved 3
    with CheckpointManager(str(directory), cluster) as m:
        assert m.all_steps() == [1, 2, 3]
        for step, seed in ((1, 7), (2, 8), (3, 9)):
            assert orbax_states.mismatches(m.restore(step, orbax_states.target(seed)), seed) == []


@pytest.fixture
def gcs_cluster(make_cluster, gcs_server, cluster):
    """Two sidecars whose environment points at the GCS server."""
    c = make_cluster(hosts=2, arena_size=32 * MiB, env=gcs_server.env)
    yield c.make_current()
    cluster.make_current()


def test_orbax_layout_on_gcs_both_ways(gcs_cluster, gcs_server, orbax_written):
    """On GCS (fake-gcs-server): Orbax restores colocar's step (finished by
    commit_success.txt, written in place), colocar restores Orbax's, and an Orbax step without
    its commit_success.txt is neither listed nor restored."""
    gcs_server.create_bucket("orbax-both-ways")
    url = "gs://orbax-both-ways/run"
    with CheckpointManager(url, gcs_cluster, layout="orbax") as m:
        m.save(4, orbax_states.state(4))
        m.wait()
        assert m.all_steps() == [4]
    assert peer("restore", url, 4, 4, env=gcs_server.env) == ["restored"]
    assert peer("continue", url, 6, env=gcs_server.env) == ["continued 5"]
    with CheckpointManager(url, gcs_cluster) as m:
        assert m.all_steps() == [4, 5]
        assert orbax_states.mismatches(m.restore(5, orbax_states.target(6)), 6) == []
        _bucket().blob("run/5/commit_success.txt").delete()  # step 5 as Orbax leaves it before its commit
        assert m.all_steps() == [4]
        with pytest.raises(CheckpointError, match=r"step 5 is not a committed checkpoint.*unfinished.*\[5\]"):
            m.restore(5, orbax_states.target(6))


def _bucket():
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    return storage.Client(project="colocar", credentials=AnonymousCredentials()).bucket("orbax-both-ways")


def _files(step_dir) -> list[str]:
    """The names under a step, with the databases' content-addressed files left out."""
    found = []
    for root, dirs, files in os.walk(step_dir):
        rel = os.path.relpath(root, step_dir)
        dirs[:] = [d for d in dirs if d != "d"]
        found += [os.path.normpath(os.path.join(rel, f)) for f in files]
    return sorted(found)


def test_the_layout_is_the_one_this_orbax_writes(cluster, orbax_written, tmp_path):
    """Fails loudly when an Orbax release changes a file colocar's layout relies on: the same
    state saved by Orbax's default `CheckpointManager` and by colocar gives the same files, the
    same tree metadata (but zarr3, which colocar writes for its checksums, as Orbax's v1 does),
    the same shardings and the same step metadata fields."""
    import orbax.checkpoint

    with CheckpointManager(str(tmp_path / "ours"), cluster, layout="orbax") as m:
        m.save(1, orbax_states.state(7))
        m.wait()
    ours, theirs = tmp_path / "ours" / "1", orbax_written / "ocdbt" / "1"
    processes = {f"{names.ITEM}/ocdbt.process_1/manifest.ocdbt", f"{names.ITEM}/array_metadatas/process_1"}
    assert set(_files(ours)) - processes == set(_files(theirs)), (
        f"orbax-checkpoint {orbax.checkpoint.__version__}"
    )
    read = {side: json.loads((side / names.ITEM / names.METADATA).read_text()) for side in (ours, theirs)}
    assert (read[ours].pop("use_zarr3"), read[theirs].pop("use_zarr3")) == (True, False)
    for side in read.values():
        side.pop("custom_metadata")
        for leaf in side["tree_metadata"].values():
            leaf["value_metadata"].pop("write_shape", None)  # the chunks each wrote
    assert read[ours] == read[theirs]
    shardings = [json.loads((side / names.ITEM / names.SHARDING).read_text()) for side in (ours, theirs)]
    assert shardings[0] == shardings[1]
    steps = [json.loads((side / names.CHECKPOINT_METADATA).read_text()) for side in (ours, theirs)]
    assert steps[0].keys() == steps[1].keys() and steps[0]["item_handlers"] == steps[1]["item_handlers"]


def test_multi_controller_both_ways(make_cluster, tmp_path, cluster):
    """Two jax.distributed processes, each with its own sidecar, write Orbax's layout (one
    OCDBT database per host, merged at commit) and Orbax restores it in one process; two Orbax
    processes write a step and the two colocar processes restore it."""
    sidecars = make_cluster(hosts=2, arena_size=16 * MiB, persist=True)
    directory = tmp_path / "multi"
    try:
        run_two(sidecars, "ckpt_multi_orbax", str(directory), "save")  # each checks its restore
        item = directory / "2" / names.ITEM
        assert {"ocdbt.process_0", "ocdbt.process_1"} <= set(os.listdir(item))
        assert peer("restore", directory, 2, 11) == ["restored"]
        written = tmp_path / "orbax-multi"
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = str(s.getsockname()[1])
        peers = [
            subprocess.Popen(
                [sys.executable, program("orbax_peer"), "save-multi", str(written), "12", str(i), port],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for i in range(2)
        ]
        for p in peers:
            out = p.communicate(timeout=240)[0]
            assert p.returncode == 0 and out.strip().endswith("saved"), out[-3000:]
        run_two(sidecars, "ckpt_multi_orbax", str(written), "restore")
    finally:
        cluster.make_current()


def test_a_damaged_or_lost_data_file_is_a_clear_error(cluster, tmp_path):
    """colocar's zarr3 chunks carry a crc32c, in Orbax's layout too: a flipped byte in a host's
    OCDBT data file, or the file gone, fails the restore naming the host; never a wrong value."""
    directory = tmp_path / "damaged"
    state = orbax_states.state(3)
    with CheckpointManager(str(directory), cluster, layout="orbax") as m:
        m.save(1, state)
        m.wait()
        data = directory / "1" / names.ITEM / "ocdbt.process_0" / "d"
        biggest = max(data.iterdir(), key=lambda f: f.stat().st_size)
        body = bytearray(biggest.read_bytes())
        body[len(body) // 2] ^= 0x40
        biggest.write_bytes(bytes(body))
        with pytest.raises(
            CheckpointError, match=r"restoring step 1 on host \d failed: .*(?i:checksum|digest|crc)"
        ):
            m.restore(1, orbax_states.target(3))
        biggest.unlink()
        with pytest.raises(CheckpointError, match=r"restoring step 1 on host \d failed"):
            m.restore(1, orbax_states.target(3))


def _ckpt(*args) -> subprocess.CompletedProcess:
    """`colocar ckpt ARGS` as a user runs it (a process of its own, no sidecar)."""
    run = [sys.executable, "-m", "colocar", "ckpt", *map(str, args)]
    return subprocess.run(run, capture_output=True, text=True, timeout=120)


def test_ckpt_ls_show_and_convert_both_ways(cluster, orbax_written, tmp_path):
    """`colocar ckpt` lists and shows steps of either layout; `convert` turns Orbax's into
    colocar's format and colocar's into Orbax's layout, which Orbax then restores."""
    mixed = tmp_path / "mixed"
    shutil.copytree(orbax_written / "ocdbt", mixed)  # Orbax's step 1
    with CheckpointManager(str(mixed), cluster) as m:  # colocar's format: step 2
        m.save(2, orbax_states.state(8))
        m.wait()
    listing = json.loads(_ckpt("ls", mixed, "--json").stdout.strip().splitlines()[-1])
    assert [(s["step"], s["status"], s["layout"]) for s in listing["steps"]] == [
        (1, "committed", "orbax"),
        (2, "committed", "colocar"),
    ]
    show = _ckpt("show", mixed, 1)
    assert (
        show.returncode == 0
        and "['params']['dense']['kernel']" in show.stdout
        and "orbax layout" in show.stdout
    )
    converted = tmp_path / "converted"
    run = _ckpt("convert", mixed, converted)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == [
        "step 1: orbax -> colocar (6 arrays)",
        "step 2: colocar -> orbax (6 arrays)",
    ]
    with CheckpointManager(str(converted), cluster) as m:
        assert m.all_steps() == [1, 2]
        assert m.catalog.holder(1).layout == "colocar" and m.catalog.holder(2).layout == "orbax"
        for step, seed in ((1, 7), (2, 8)):
            assert orbax_states.mismatches(m.restore(step, orbax_states.target(seed)), seed) == []
    assert peer("restore", converted, 2, 8) == ["restored"]
    again = _ckpt("convert", mixed, converted, "--step", 2)
    assert again.returncode == 2 and "step 2 exists" in again.stderr
