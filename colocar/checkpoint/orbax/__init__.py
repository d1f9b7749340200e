"""Orbax's own on-storage layout, written by the sidecars and read like colocar's format.

`CheckpointManager(directory, cluster, layout="orbax")` writes what orbax-checkpoint 0.12's
`ocp.CheckpointManager` writes for one item (`<directory>/<step>/default/`), so Orbax, its v1
API and the tools built on them read colocar's checkpoints; any manager restores Orbax's.
`names` (the files and directories), `files` (their contents), `steps` (the step directories,
as `checkpoint.store.steps.StepDirs` for colocar's format), `commit` (the primary's commit, in the
sidecar), `foreign` (a manifest for a step Orbax itself wrote) and `shardings` (the
controller's part: key paths and shardings as Orbax writes them).
"""
