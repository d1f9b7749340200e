"""tensorstore's first import holds a sidecar's GIL (~0.3 s; over a second with ml_dtypes 0.7);
taken by a first save or restore it stalled every keepalive and call in flight on that sidecar.
A checkpoint manager has its sidecars import it as it is made, and `--preload tensorstore`
imports it before a sidecar serves (`colocar.sidecar.preload`); a sidecar that never
checkpoints never pays for it.
"""

from __future__ import annotations

import threading

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import colocar
from colocar.checkpoint import CheckpointManager

MiB = 1 << 20


@colocar.colocated
def _loaded() -> list[str]:
    import sys

    return sorted(m for m in ("tensorstore", "ml_dtypes", "jax", "grain") if m in sys.modules)


@colocar.colocated
def _ping(i: int) -> int:
    return i


def test_a_manager_has_its_sidecars_import_tensorstore_as_it_is_made(make_cluster, tmp_path):
    """A fresh sidecar has imported neither tensorstore nor JAX; once a checkpoint manager is
    made on the cluster, every sidecar has tensorstore (and ml_dtypes, the costly part), and
    still no JAX or grain (they come only with shipped code that uses them)."""
    c = make_cluster(hosts=2, processes=0)
    assert _loaded.on(c.hosts)() == [[], []]
    CheckpointManager(str(tmp_path / "ckpt"), c).close()
    assert _loaded.on(c.hosts)() == [["ml_dtypes", "tensorstore"]] * 2


def test_a_sidecar_started_with_preload_serves_with_the_module_imported(tmp_path):
    """`colocar sidecar --preload tensorstore`: the first call it answers finds it loaded."""
    from security_helpers import running_sidecar

    with running_sidecar(tmp_path, "--preload", "tensorstore", "--processes", "0") as sidecar:
        c = colocar.connect([sidecar.address])
        try:
            assert _loaded.on(c.hosts)() == [["ml_dtypes", "tensorstore"]]
        finally:
            c.close()


def test_a_first_save_and_restore_import_nothing_and_calls_go_on_through_them(make_cluster, tmp_path):
    """Fresh sidecars with the suite's quick keepalives (a 0.5 s heartbeat, a 2 s lease): the
    manager's making imported tensorstore, so their first save and restore import nothing (an
    import holds the sidecar's GIL: every keepalive and call would wait on it), and calls made
    to them meanwhile all return, with no host lost."""
    c = make_cluster(hosts=2, processes=0, arena_size=32 * MiB).make_current()
    m = CheckpointManager(str(tmp_path / "ckpt"), c)
    loaded = _loaded.on(c.hosts)()
    assert loaded == [["ml_dtypes", "tensorstore"]] * 2
    value = np.arange(64 * 256, dtype=np.float32).reshape(64, 256)
    x = jax.device_put(value, NamedSharding(c.mesh(("d",)), P("d")))
    done = threading.Event()
    errors: list[BaseException] = []

    def save_and_restore() -> None:
        try:
            try:
                m.save(1, {"x": x})
                m.wait()
                restored = m.restore(1)
                np.testing.assert_array_equal(np.asarray(restored["x"]), value)
            finally:
                m.close()
        except BaseException as e:  # noqa: BLE001 - raised by the test below
            errors.append(e)
        finally:
            done.set()

    worker = threading.Thread(target=save_and_restore)
    worker.start()
    answered = 0
    while answered == 0 or not done.wait(0.01):
        assert _ping.on(c.hosts)(answered) == [answered, answered]
        answered += 1
    worker.join()
    assert not errors, errors
    assert all(host.connection.session.lost is None for host in c.hosts)
    assert _loaded.on(c.hosts)() == loaded  # the save and the restore imported none of them
