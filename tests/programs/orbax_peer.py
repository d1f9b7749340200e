"""Orbax alone, as a user's Orbax job runs it: this process never imports colocar.

Run by test_checkpoint_orbax.py. argv:
- `save BASE SEED`: writes `orbax_states.state(SEED)` in every way the tests read, each under
  BASE/<way>: `ocdbt` (ocp.CheckpointManager's default: OCDBT, zarr v2, step 1), `zarr3`
  (OCDBT, zarr3), `per-array` (no OCDBT: one directory per array), `standard` (a
  StandardCheckpointer directory, no steps), `v1` (orbax.checkpoint.v1's save_pytree).
- `restore DIR STEP SEED`: restores step STEP with `ocp.CheckpointManager(DIR).restore(step,
  args=ocp.args.StandardRestore(target))` and with v1's `load_pytree`, onto another mesh;
  prints "restored" when both are bit for bit `values(SEED)`, else what differs.
- `restore-training DIR STEP SEED`: restores step STEP with v1's `training.Checkpointer(DIR)`
  (its `state` item), onto another mesh; prints "restored" or what differs.
- `continue DIR SEED`: an Orbax job picking up DIR: restores its latest step, saves the next
  one with Orbax (SEED's state), prints "continued <step>".
- `save-multi DIR SEED PROCESS PORT`: one of two jax.distributed processes (4 devices each)
  saving SEED's state as step 1 together; prints "saved".
Prints "colocar imported" and exits 3 if anything imported colocar.
"""

import os
import sys

DEVICES = 4 if sys.argv[1] == "save-multi" else 8  # two processes of 4, or one of 8
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={DEVICES}"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/

import orbax.checkpoint as ocp  # noqa: E402
import orbax_states  # noqa: E402
from orbax.checkpoint import v1 as ocp1  # noqa: E402


def save(base: str, seed: int) -> None:
    state = orbax_states.state(seed)
    for way, handler in {
        "ocdbt": ocp.StandardCheckpointHandler(),  # what ocp.CheckpointManager saves by default
        "zarr3": ocp.PyTreeCheckpointHandler(use_zarr3=True),
        "per-array": ocp.PyTreeCheckpointHandler(use_ocdbt=False),
    }.items():
        with ocp.CheckpointManager(os.path.join(base, way), item_handlers=handler) as m:
            m.save(1, args=ocp.args.StandardSave(state) if way == "ocdbt" else ocp.args.PyTreeSave(state))
            m.wait_until_finished()
    with ocp.StandardCheckpointer() as c:
        c.save(os.path.join(base, "standard"), state)
    ocp1.save_pytree(os.path.join(base, "v1"), state)
    print("saved", flush=True)


def restore(directory: str, step: int, seed: int) -> None:
    target = orbax_states.target(seed)
    with ocp.CheckpointManager(directory) as m:
        restored = m.restore(step, args=ocp.args.StandardRestore(target))
    bad = orbax_states.mismatches(restored, seed)
    loaded = ocp1.load_pytree(os.path.join(directory, str(step)), target)
    bad += [f"v1: {b}" for b in orbax_states.mismatches(loaded, seed)]
    print("\n".join(bad) if bad else "restored", flush=True)


def restore_training(directory: str, step: int, seed: int) -> None:
    with ocp1.training.Checkpointer(directory) as c:
        loaded = c.load(step, orbax_states.target(seed))
    bad = orbax_states.mismatches(loaded, seed)
    print("\n".join(bad) if bad else "restored", flush=True)


def continue_job(directory: str, seed: int) -> None:
    with ocp.CheckpointManager(directory) as m:
        latest = m.latest_step()
        m.restore(latest, args=ocp.args.StandardRestore(orbax_states.target(seed)))
        m.save(latest + 1, args=ocp.args.StandardSave(orbax_states.state(seed)))
        m.wait_until_finished()
    print("continued", latest + 1, flush=True)


def save_multi(directory: str, seed: int, process: int, port: str) -> None:
    import jax

    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process)
    with ocp.CheckpointManager(directory) as m:
        m.save(1, args=ocp.args.StandardSave(orbax_states.state(seed)))
        m.wait_until_finished()
    print("saved", flush=True)


if __name__ == "__main__":
    command, args = sys.argv[1], sys.argv[2:]
    if command == "save":
        save(args[0], int(args[1]))
    elif command == "restore":
        restore(args[0], int(args[1]), int(args[2]))
    elif command == "restore-training":
        restore_training(args[0], int(args[1]), int(args[2]))
    elif command == "save-multi":
        save_multi(args[0], int(args[1]), int(args[2]), args[3])
    else:
        continue_job(args[0], int(args[1]))
    if any(name.split(".")[0] == "colocar" for name in sys.modules):
        print("colocar imported", flush=True)
        sys.exit(3)
