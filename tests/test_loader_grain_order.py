"""`shuffle_order: grain`: the records come in grain's own order, checked against grain itself.

grain's reference is its public API: ``grain.MapDataset.source(range(n)).seed(seed).shuffle()``,
with ``.repeat(E)`` for several epochs (grain reshuffles each one). The loader runs on real local
sidecars (one and two hosts, their worker processes, ring slots); the record id of each row is
its `label`. The default order (``colocar``) is checked against the batches it gave before the
option existed, so existing record streams and checkpoints stay the same.
"""

from __future__ import annotations

import json
import subprocess
import sys

import grain
import numpy as np
import pytest
from loaders_helpers import config, features, labels, take

import colocar
from colocar import loaders
from colocar.elastic.policy.data import start_batch
from colocar.elastic.policy.survivors import ElasticError
from colocar.loaders.config import ConfigError, load_config
from colocar.loaders.orders import GrainOrder, _grain_internals
from colocar.loaders.sampler import IndexSampler

# IndexSampler(24, 8, seed=1234, num_epochs=2) before `shuffle_order` existed: batches 0..5.
COLOCAR_24_8_1234 = [
    [11, 14, 7, 9, 8, 4, 12, 1],
    [19, 13, 21, 15, 3, 20, 10, 18],
    [17, 23, 5, 6, 22, 2, 0, 16],
    [14, 13, 22, 16, 7, 5, 2, 20],
    [23, 1, 10, 3, 9, 21, 12, 19],
    [18, 17, 0, 4, 8, 11, 15, 6],
]


def grain_epochs(n: int, seed: int, epochs: int) -> list[list[int]]:
    """grain's record ids, epoch by epoch, of `.seed(seed).shuffle().repeat(epochs)`."""
    flat = list(grain.MapDataset.source(range(n)).seed(seed).shuffle().repeat(epochs))
    return [flat[e * n : (e + 1) * n] for e in range(epochs)]


def grain_batches(n: int, B: int, seed: int, epochs: int) -> list[list[int]]:
    """grain's order cut into colocar's global batches: whole batches of each epoch (drop_remainder)."""
    out = []
    for order in grain_epochs(n, seed, epochs):
        out += [order[k * B : (k + 1) * B] for k in range(n // B)]
    return out


def grain_config(n: int, B: int, **overrides):
    return config(
        source={"kind": "range", "n": n},
        global_batch_size=B,
        transforms=[{"kind": "map", "fn": features}],
        shuffle_order="grain",
        **overrides,
    )


@pytest.fixture(scope="module")
def one_host():
    with colocar.local_cluster(hosts=1, arena_size=16 << 20, processes=0) as c:
        yield c


# ---------------------------------------------------------------------------------------------
# The order itself (no sidecars)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 7, 100, 1000])
@pytest.mark.parametrize("seed", [0, 1, 1234, 2**32 + 5])
def test_the_sampler_gives_grains_order_epoch_after_epoch(n, seed):
    s = IndexSampler(n, 1, seed=seed, num_epochs=3, shuffle_order="grain")
    assert [s.epoch_order(e).tolist() for e in range(3)] == grain_epochs(n, seed, 3)


def test_grains_internals_are_used_only_where_they_match_its_public_api(n=100, seed=3):
    for fast in (True, False):  # grain's index_shuffle (checked) and grain's dataset itself
        order = GrainOrder(n, seed, fast)
        assert [order.take(e, 0, n).tolist() for e in range(3)] == grain_epochs(n, seed, 3)
    ds = grain.MapDataset.source(range(n)).seed(seed).shuffle()
    assert _grain_internals(ds, n) is not None  # the installed grain: the fast path
    assert _grain_internals(ds, n + 1) is None  # internals that disagree with ds: refused
    assert _grain_internals(ds.map(lambda i: i), n) is None  # no shuffle seed where expected


def test_grain_is_imported_only_when_a_batch_needs_its_order():
    """The sidecar builds a sampler for the batch count: that must not pay for importing grain."""
    code = (
        "import sys; from colocar.loaders.sampler import IndexSampler\n"
        "s = IndexSampler(10, 2, seed=1, shuffle_order='grain'); s.num_batches\n"
        "assert 'grain' not in sys.modules, 'imported too early'\n"
        "s.batch_indices(0); assert 'grain' in sys.modules, 'never imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_batches_and_host_rows_cut_grains_order(n=50, B=8, seed=99):
    s = IndexSampler(n, B, seed=seed, num_epochs=None, shuffle_order="grain")
    reference = grain_batches(n, B, seed, 4)
    assert [s.batch_indices(k).tolist() for k in range(len(reference))] == reference
    # any split of the rows (hosts, devices) gives the same batch
    for k in (0, 7, 13):
        rows = [s.batch_indices(k, slice(lo, lo + 2)).tolist() for lo in range(0, B, 2)]
        assert sum(rows, []) == reference[k]
    padded = IndexSampler(n, B, seed=seed, num_epochs=1, drop_remainder=False, shuffle_order="grain")
    last = padded.batch_indices(n // B).tolist()
    assert last == grain_epochs(n, seed, 1)[0][(n // B) * B :] + [-1] * (B - n % B)


def test_the_default_order_is_unchanged_and_shuffle_false_reads_in_order():
    for order in ({}, {"shuffle_order": "colocar"}):
        s = IndexSampler(24, 8, seed=1234, num_epochs=2, **order)
        assert [s.batch_indices(k).tolist() for k in range(6)] == COLOCAR_24_8_1234
    assert load_config(config()).shuffle_order == "colocar"
    for kind in ("colocar", "grain"):
        s = IndexSampler(24, 8, seed=1234, num_epochs=2, shuffle=False, shuffle_order=kind)
        assert s.batch_indices(4).tolist() == list(range(8, 16))
    assert COLOCAR_24_8_1234[:3] != [b.tolist() for b in np.split(np.array(grain_epochs(24, 1234, 1)[0]), 3)]


# ---------------------------------------------------------------------------------------------
# The config key
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, message",
    [
        ("graim", "expected one of 'colocar', 'grain', got 'graim'; did you mean 'grain'?"),
        ("numpy", "expected one of 'colocar', 'grain', got 'numpy'"),
        (True, "expected one of 'colocar', 'grain', got bool True"),
    ],
)
def test_a_bad_shuffle_order_is_a_config_error_naming_the_key(value, message):
    with pytest.raises(ConfigError) as e:
        load_config(config(shuffle_order=value))
    assert str(e.value) == f"pipeline config: shuffle_order: {message}"


def test_shuffle_order_round_trips_and_a_typo_of_the_key_is_named():
    cfg = load_config(config(shuffle_order="grain"))
    assert cfg.to_dict()["shuffle_order"] == "grain"
    assert load_config(json.loads(json.dumps(cfg.to_dict()))).shuffle_order == "grain"
    with pytest.raises(ConfigError, match=r"shufle_order: unknown key; did you mean 'shuffle_order'\?"):
        load_config(config(shufle_order="grain"))


# ---------------------------------------------------------------------------------------------
# End to end on sidecars
# ---------------------------------------------------------------------------------------------


def test_two_hosts_deliver_grains_records_over_the_epoch_boundary(cluster):
    n, B, seed = 48, 16, 1234
    with loaders.load(grain_config(n, B, seed=seed, num_epochs=2, workers_per_host=2), cluster) as it:
        got = [labels(b) for b in it]
    flat = list(grain.MapDataset.source(range(n)).seed(seed).shuffle().repeat(2))
    assert sum(got, []) == flat  # n a multiple of B: the very stream grain's .batch(B) would cut
    assert got == grain_batches(n, B, seed, 2)


def test_one_host_delivers_grains_records_and_drops_each_epochs_remainder(one_host):
    n, B, seed = 100, 16, 7
    c = one_host.make_current()
    with loaders.load(grain_config(n, B, seed=seed, num_epochs=2), c) as it:
        got = [labels(b) for b in it]
    assert got == grain_batches(n, B, seed, 2)  # 6 batches per epoch, 4 records of each dropped


def test_the_default_order_on_sidecars_is_the_stored_one(cluster):
    cfg = config(source={"kind": "range", "n": 24}, global_batch_size=8, seed=1234, num_epochs=2)
    with loaders.load(cfg, cluster) as it:
        assert [labels(b) for b in it] == COLOCAR_24_8_1234


def test_a_mid_epoch_resume_continues_grains_order_on_either_host_count(cluster, one_host):
    n, B, seed = 100, 16, 5
    cfg = grain_config(n, B, seed=seed, num_epochs=2)
    reference = grain_batches(n, B, seed, 2)
    with loaders.load(cfg, cluster) as it:
        assert take(it, 4, labels) == reference[:4]
        state = json.loads(json.dumps(it.get_state()))
    assert state["shuffle_order"] == "grain" and state["next_batch"] == 4
    with loaders.load(cfg, cluster) as it:  # 2 hosts -> 2 hosts, over the epoch boundary (6)
        it.set_state(state)
        assert take(it, 4, labels) == reference[4:8]
    c = one_host.make_current()
    with loaders.load(cfg, c) as it:  # 2 hosts -> 1 host, to the end
        it.set_state(state)
        assert [labels(b) for b in it] == reference[4:]
    cluster.make_current()


def test_a_resume_with_the_other_order_is_refused(cluster):
    small = config(source={"kind": "range", "n": 32}, global_batch_size=8, num_epochs=1)
    with loaders.load(small, cluster) as it:
        take(it, 1, labels)
        colocar_state = it.get_state()
    with loaders.load(grain_config(32, 8, num_epochs=1), cluster) as it:
        refused = "saved with shuffle_order='colocar' but the pipeline has 'grain'"
        with pytest.raises(ValueError, match=refused):
            it.set_state(colocar_state)
        old = {k: v for k, v in colocar_state.items() if k != "shuffle_order"}  # a state from before the key
        with pytest.raises(ValueError, match=refused):
            it.set_state(old)
        it.set_state({**colocar_state, "shuffle_order": "grain"})
        assert take(it, 1, labels) == grain_batches(32, 8, 7, 1)[1:2]


def test_the_elastic_resume_refuses_the_other_order():
    saved = {"records": 48, "global_batch_size": 16, "loader": {"seed": 7, "shuffle": True}}
    assert start_batch(saved, load_config(config()), "data") == 3  # before the key: colocar
    with pytest.raises(ElasticError, match="saved with shuffle_order='colocar' but the pipeline has 'grain'"):
        start_batch(saved, load_config(config(shuffle_order="grain")), "data")
    grain_saved = {**saved, "loader": {**saved["loader"], "shuffle_order": "grain"}}
    assert start_batch(grain_saved, load_config(config(shuffle_order="grain")), "data") == 3
    with pytest.raises(ElasticError, match="shuffle_order='grain'"):
        start_batch(grain_saved, load_config(config()), "data")


def keep_even(record):
    return int(record["label"]) % 2 == 0


def test_a_filter_keeps_the_batch_shape_with_mask_where_grain_drops_records(cluster):
    n, B, seed = 32, 8, 11
    transforms = [{"kind": "map", "fn": features}, {"kind": "filter", "fn": keep_even}]
    cfg = grain_config(n, B, seed=seed, num_epochs=1)
    with loaders.load({**cfg, "transforms": transforms}, cluster) as it:
        batches = [(labels(b), np.asarray(b["mask"]).tolist()) for b in it]
    assert all(len(rows) == B for rows, _ in batches)  # grain's .filter would shorten the stream
    kept = [x for rows, mask in batches for x, m in zip(rows, mask, strict=True) if m]
    shuffled = grain.MapDataset.source(range(n)).seed(seed).shuffle()
    assert kept == list(shuffled.filter(lambda i: i % 2 == 0))
    padded = [[x if x % 2 == 0 else 0 for x in b] for b in grain_batches(n, B, seed, 1)]
    assert [rows for rows, _ in batches] == padded  # a dropped record's row: zeros, mask false
