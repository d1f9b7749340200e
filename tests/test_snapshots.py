"""Host-memory snapshots with peer replicas (`colocar.elastic.Snapshots`), on real sidecars.

Four local sidecars stand for four hosts (2 devices each); a host is lost by SIGKILL. Replicas
travel sidecar to sidecar over gRPC. Restores go onto a mesh of the survivors' devices and
must be bit-exact; the arena pool's used bytes show which snapshots hold blocks.
"""

from __future__ import annotations

import random
import threading
import time

import jax
import ml_dtypes
import numpy as np
import pytest
from checkpoint_helpers import assert_same
from helpers import wait_for
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from security_helpers import kill_sidecar, running_sidecar
from test_security_tls import pki  # noqa: F401 - the certificates, as a fixture

import colocar
from colocar.checkpoint.format import tree
from colocar.controller_bridge.obj import colocated_class
from colocar.elastic.snapshots import Snapshots
from colocar.elastic.snapshots.keepers.keeper import SnapshotKeeper
from colocar.elastic.snapshots.keepers.peers import PeerOptions
from colocar.elastic.snapshots.take import SnapshotSkipped
from colocar.errors import ColocarError, SnapshotError

MiB = 1 << 20
POOL = "snap"
_Keeper = colocated_class(SnapshotKeeper)


@pytest.fixture(scope="module")
def four_hosts():
    """Four sidecars with a 1 MiB snapshot pool, shared by the tests that lose no host."""
    import colocar

    with colocar.local_cluster(
        hosts=4,
        arena_size=16 * MiB,
        pools={POOL: 1 * MiB},
        processes=0,
        lease_seconds=6,  # a killed sidecar is lost at once (its exit is watched); a sidecar
        heartbeat_seconds=1.0,  # stalled a second by its first tensorstore import is not
    ) as c:
        yield c


def _cluster(make_cluster, pool_bytes: int = 4 * MiB, shm: bool = True):
    arena = 12 * MiB + pool_bytes
    patient = {"lease_seconds": 6, "heartbeat_seconds": 1.0}  # as in `four_hosts`
    return make_cluster(hosts=4, arena_size=arena, pools={POOL: pool_bytes}, processes=0, shm=shm, **patient)


def _state(cluster, seed: int, rows: int = 64) -> dict:
    """Arrays over the 4 hosts x 2 devices (sharded, replicated, a PRNG key, a numpy leaf)
    and plain values."""
    mesh = Mesh(np.array(cluster.devices).reshape(4, 2), ("data", "model"))
    rng = np.random.default_rng(seed)
    return {
        "params": {
            "w": jax.device_put(
                rng.standard_normal((rows, 32), np.float32), NamedSharding(mesh, P("data", "model"))
            ),
            "b": jax.device_put(rng.standard_normal(32).astype(ml_dtypes.bfloat16), NamedSharding(mesh, P())),
        },
        "key": jax.device_put(jax.random.key(seed), NamedSharding(mesh, P())),
        "scale": jax.device_put(np.float32(seed + 0.5), NamedSharding(mesh, P())),
        "table": rng.integers(0, 100, (8, 3)),
        "step": seed,
        "data": {"epoch": 1, "positions": [seed, 5]},
    }


def _target(state: dict, cluster, lost: set[int]) -> dict:
    """The state's shapes on a mesh of the survivors' devices (resharded)."""
    devices = [d for h in cluster.hosts if h.index not in lost for d in h.devices]
    mesh = Mesh(np.array(devices).reshape(len(devices) // 2, 2), ("data", "model"))

    def leaf(x):
        if isinstance(x, jax.Array):
            spec = P(None, "model") if x.ndim == 2 else P()
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))
        return x

    return jax.tree_util.tree_map(leaf, state)


def _kill(cluster, *hosts: int) -> None:
    for h in hosts:
        cluster.processes[h].kill()
    for h in hosts:
        cluster.processes[h].wait(timeout=30)


def _used(cluster, hosts) -> list[int]:
    return [cluster.hosts[h].stats()["pools"][POOL]["used"] for h in hosts]


def _wait_used(cluster, hosts, expected: list[int]) -> list[int]:
    """The pool's used bytes once they reach `expected` (released blocks go back in the
    background), or what they are after a generous deadline."""
    deadline = time.monotonic() + 30
    while (used := _used(cluster, hosts)) != expected and time.monotonic() < deadline:
        time.sleep(0.05)
    return used


@colocar.colocated
def _jax_loaded() -> bool:
    import sys

    return "jax" in sys.modules


def test_one_replica_survives_a_killed_host(make_cluster):
    cluster = _cluster(make_cluster, pool_bytes=8 * MiB)
    with Snapshots(cluster, replicas=1, pool=POOL) as snaps:
        state = _state(cluster, 1, rows=65536)  # 1 MiB shards: a replica goes in several chunks
        assert snaps.take(1, state)
        snaps.wait(60)
        assert snaps.stats()["replication"]["state"] == "committed"
        # each sidecar has the controller's session and its ring predecessor's (sidecar to sidecar)
        assert [h.stats()["sessions"] for h in cluster.hosts] == [2, 2, 2, 2]
        # replicating made no sidecar import JAX (its link to the peer is the controller's
        # connection code, without the rest of the controller side)
        assert [_jax_loaded.on(h)() for h in cluster.hosts] == [False] * 4
        _kill(cluster, 2)
        assert snaps.latest() == 1
        restored = snaps.restore(1, _target(state, cluster, {2}))
        assert_same(restored, state)
        assert all(
            d.id not in {x.id for x in cluster.hosts[2].devices} for d in restored["params"]["w"].devices()
        )


def test_two_replicas_survive_two_hosts_lost_at_once(make_cluster):
    """Also with a controller that does not map the arenas: shards are uploaded, restores
    downloaded."""
    cluster = _cluster(make_cluster, shm=False)
    with Snapshots(cluster, replicas=2, pool=POOL) as snaps:
        state = _state(cluster, 2)
        assert snaps.take(7, state)
        snaps.wait(60)
        _kill(cluster, 1, 2)
        assert snaps.latest() == 7
        survivors = [cluster.hosts[0], cluster.hosts[3]]
        assert snaps.latest(survivors) == snaps.latest([0, 3]) == 7
        assert snaps.latest([cluster.hosts[0]]) is None  # host 1's shards are on 1, 2 and 3 only
        assert_same(snaps.restore(7, _target(state, cluster, {1, 2}), survivors), state)


def test_a_shard_and_its_only_replica_lost_is_not_recoverable(make_cluster):
    cluster = _cluster(make_cluster)
    with Snapshots(cluster, replicas=1, pool=POOL) as snaps:
        state = _state(cluster, 3)
        assert snaps.take(1, state)
        snaps.wait(60)
        _kill(cluster, 1, 2)  # host 1's shards had their only replica on host 2
        assert snaps.latest() is None
        with pytest.raises(SnapshotError, match=r"step 1 is not recoverable: .* of host 1 .*\[2\]"):
            snaps.restore(1, _target(state, cluster, {1, 2}))


def test_a_host_lost_before_a_snapshot_keeps_the_previous_one(make_cluster):
    cluster = _cluster(make_cluster)
    with Snapshots(cluster, replicas=1, pool=POOL) as snaps:
        first = _state(cluster, 6)
        assert snaps.take(1, first)
        snaps.wait(60)
        _kill(cluster, 0)
        with pytest.raises(ColocarError, match="host ?0"):
            snaps.take(2, _state(cluster, 7))
        assert snaps.latest() == 1
        restored = snaps.restore(1, _target(first, cluster, {0}))
        assert_same(restored, first)
        # training goes on on the survivors: the next snapshots go to them (ring 1 -> 2 -> 3 -> 1)
        _wait_lost(cluster, 0)
        assert snaps.take(2, restored)
        snaps.wait(60)
        assert snaps.latest() == 2
        _kill(cluster, 2)
        assert_same(snaps.restore(2, _target(first, cluster, {0, 2})), first)


def _wait_lost(cluster, h: int) -> None:
    deadline = time.monotonic() + 30
    while cluster.hosts[h].connection.session.lost is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cluster.hosts[h].connection.session.lost is not None


def test_a_snapshot_larger_than_its_pool_is_skipped_and_training_goes_on(four_hosts):
    cluster = four_hosts.make_current()
    with pytest.raises(SnapshotError, match="host 0 has no arena pool 'nope'"):
        Snapshots(cluster, pool="nope")
    with Snapshots(cluster, replicas=1, pool=POOL) as snaps:
        big = _state(cluster, 8, rows=32768)  # 1 MiB of w per host, twice with the replica
        with pytest.warns(
            SnapshotSkipped, match=r"step 3 skipped: host 0 needs \d+ bytes in arena pool 'snap'"
        ):
            assert snaps.take(3, big) is False
        assert snaps.latest() is None
        assert _wait_used(cluster, range(4), [0] * 4) == [0] * 4
        with pytest.raises(SnapshotError, match=r"leaf \['lock'\] \(lock\) cannot be stored"):
            snaps.take(3, {**_state(cluster, 8), "lock": threading.Lock()})
        small = _state(cluster, 9)
        assert snaps.take(4, small)
        snaps.wait(60)
        assert snaps.latest() == 4
        assert snaps.stats()["skipped"] == 1


def test_only_the_two_newest_complete_snapshots_hold_blocks(four_hosts):
    cluster = four_hosts.make_current()
    hosts = range(4)
    with Snapshots(cluster, replicas=1, pool=POOL) as snaps:
        assert snaps.take(1, _state(cluster, 1))
        snaps.wait(60)
        spare = [snaps.stats()["spare_bytes"].get(h, 0) for h in hosts]  # the next take's block
        assert all(n > 0 for n in spare)
        # one snapshot: a host's shards and the replica it holds (and the spare)
        one = [n - s for n, s in zip(_used(cluster, hosts), spare, strict=True)]
        assert all(n > 0 for n in one)
        for step in (2, 3, 4):  # each take waits for the previous one's replication
            assert snaps.take(step, _state(cluster, step))
        snaps.wait(60)
        assert snaps.latest() == 4
        two = [2 * n + s for n, s in zip(one, spare, strict=True)]
        assert _wait_used(cluster, hosts, two) == two
        assert snaps.stats()["committed"] == [3, 4]
        # a late replica of an earlier attempt at a step is refused, never mixed in
        keeper = cluster.hosts[1].object(f"colocar.snapshots/{snaps.name}/1")
        with pytest.raises(KeyError, match="holds no snapshot of step 4"):
            keeper.receive(4, "an earlier attempt", 0, 0, [[0, 8]], np.dtype("f4"), (8,), 0, bytes(32))
    assert _wait_used(cluster, hosts, [0] * 4) == [0] * 4


def test_a_new_controller_finds_the_snapshots_by_name(four_hosts):
    cluster = four_hosts.make_current()
    first = Snapshots(cluster, replicas=1, pool=POOL)
    state = _state(cluster, 10)
    assert first.take(5, state)
    first.wait(60)
    with Snapshots(cluster, replicas=1, pool=POOL, name=first.name) as again:  # the keepers are detached
        assert again.latest() == 5
        assert_same(again.restore(5, _target(state, cluster, set())), state)
    first.close()


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(10))
def test_a_host_killed_at_a_random_moment_never_gives_a_wrong_snapshot(make_cluster, seed):
    """Whenever a host dies (during the copy, the replication or after the commit), `latest()`
    names a complete snapshot and restores it bit-exactly."""
    rng = random.Random(seed)
    cluster = _cluster(make_cluster)
    # 256 KiB/s: each host's 512 KiB take ~2 s to reach its peer
    with Snapshots(cluster, replicas=1, pool=POOL, bandwidth=rng.choice([0, 256 << 10])) as snaps:
        states = {1: _state(cluster, 1), 2: _state(cluster, 2, rows=16384)}
        assert snaps.take(1, states[1])
        snaps.wait(60)
        victim = rng.randrange(4)
        killer = threading.Timer(rng.choice([0.0, 0.01, 0.5, 1.5, 3.0]), cluster.processes[victim].kill)
        killer.start()
        try:
            snaps.take(2, states[2])
        except ColocarError:
            pass  # the victim died during the copy
        killer.join()
        cluster.processes[victim].wait(timeout=30)
        snaps.wait(60)
        step = snaps.latest()
        assert step in (1, 2)
        assert_same(snaps.restore(step, _target(states[step], cluster, {victim})), states[step])


def test_replicas_travel_between_sidecars_with_mutual_tls(pki, tmp_path):  # noqa: F811 - the fixture
    """Sidecars that take no token: each keeper reaches its peer with the client certificate."""
    tls = [
        "--tls-cert",
        str(pki.server_cert),
        "--tls-key",
        str(pki.server_key),
        "--tls-client-ca",
        str(pki.ca),
    ]
    client = {"tls_ca": str(pki.ca), "tls_cert": str(pki.client_cert), "tls_key": str(pki.client_key)}
    with running_sidecar(tmp_path, *tls) as a, running_sidecar(tmp_path, *tls) as b:
        with colocar.connect([a.address, b.address], heartbeat_seconds=0.5, **client) as cluster:
            with Snapshots(cluster, replicas=1, **client) as snaps:
                state = _state(cluster, 11)
                assert snaps.take(1, state)
                snaps.wait(60)
                assert snaps.stats()["replication"]["state"] == "committed"
                kill_sidecar(b.process, b.arena)
                assert snaps.latest() == 1
                assert_same(snaps.restore(1, _target(state, cluster, {1})), state)


def test_blocks_of_another_attempt_at_the_step_are_never_read(four_hosts):
    """A host that began another attempt at a committed step (a retake cut short) holds other
    bytes under the same shard keys: the restore reads those shards from their replicas."""
    cluster = four_hosts.make_current()
    with Snapshots(cluster, replicas=1, pool=POOL) as snaps:
        state = _state(cluster, 12)
        assert snaps.take(3, state)
        snaps.wait(60)
        keeper = cluster.hosts[2].object(f"colocar.snapshots/{snaps.name}/2")
        keys = keeper.holdings()[3]["keys"]
        arrays = [v for _, v in tree.flatten(state)[0] if tree.is_array(v)]
        keeper.begin(3, "another attempt", [], [])
        for leaf, bounds in keys:
            data = arrays[leaf]
            dtype = np.dtype((jax.random.key_data(data) if tree.is_prng_key(data) else data).dtype)
            shape = tuple(b - a for a, b in bounds)
            garbage = np.full(shape, 7, np.uint8).view(np.uint8).tobytes() * dtype.itemsize
            keeper.receive(3, "another attempt", 2, leaf, bounds, dtype, shape, 0, garbage)
        assert snaps.latest() == 3
        assert_same(snaps.restore(3, _target(state, cluster, set())), state)


def test_snapshots_without_their_controller_are_dropped_after_idle_seconds(four_hosts):
    """A controller that died without `close` pins no arena memory for longer than that. The
    idle time is asked of each keeper (`expire_if_idle`, the check its watcher makes) once the
    snapshot is committed, so no slow moment of the take can cut it short."""
    cluster = four_hosts.make_current()
    hosts = range(4)
    with Snapshots(cluster, replicas=1, pool=POOL) as snaps:
        assert snaps.take(1, _state(cluster, 13))
        snaps.wait(60)
        assert snaps.stats()["replication"]["state"] == "committed"
        assert all(n > 0 for n in _used(cluster, hosts))  # its blocks are in place
        keepers = [cluster.hosts[h].object(f"colocar.snapshots/{snaps.name}/{h}") for h in hosts]
        assert not any(k.expire_if_idle(3600.0) for k in keepers)  # its controller called lately
        for k in keepers:  # these calls are no controller's: a tenth of a second without one
            wait_for(lambda k=k: k.expire_if_idle(0.1), "the keeper to drop its idle snapshots")
        spare = [snaps.stats()["spare_bytes"][h] for h in hosts]  # the controller's, not theirs
        assert _wait_used(cluster, hosts, spare) == spare
        assert snaps.latest() is None
        assert snaps.take(2, _state(cluster, 14))  # the keepers serve the next snapshots
        snaps.wait(60)
        assert snaps.stats()["replication"]["state"] == "committed"


def test_a_keeper_drops_its_snapshots_by_itself_once_idle(four_hosts):
    """The keeper's own watcher applies `idle_seconds`, with no call from anyone."""
    host = four_hosts.hosts[1]
    keeper = _Keeper.on(host, name="colocar.snapshots/test-idle/1", ttl=60)(1, POOL, PeerOptions(), 0.2)
    try:
        keeper.begin(1, "only", [], [])
        wait_for(lambda: 1 not in keeper.stats(), "the idle keeper to drop its snapshot")
    finally:
        keeper.close()
        keeper.delete()
