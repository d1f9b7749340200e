"""`colocar demo`: the job colocar exists for, on a local cluster, in a few minutes.

A small model trained data-parallel over the sidecar hosts' devices, its input pipeline on the
sidecars, host-memory snapshots and async checkpoints to a (local fake) GCS bucket, one host
killed midway and the run recovered from RAM on the survivors. Modules: `data` (the digits data
set as ArrayRecord shards and the pipeline config), `train` (the training script
docs/getting-started.md shows), `gcs` (the fake GCS server), `display`, `plot`, `summary` and `cli`.
"""
