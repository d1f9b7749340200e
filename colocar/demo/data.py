"""The demo's data set: scikit-learn's handwritten digits as ArrayRecord shards, and its pipeline.

Runs in the controller (`write`) and in the sidecars' pipeline workers (the transforms, named
in `pipeline.yaml` as `colocar.demo.data:decode` etc.). The digits (1797 8x8 images, 0..16)
ship inside scikit-learn, so nothing is downloaded. A record is 4 bytes of its id (its index
in the training set, so the demo can check the record stream), 64 pixel bytes and a label byte.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

RECORD_BYTES = 4 + 64 + 1
PIPELINE_YAML = """\
# The demo's input pipeline: it runs in the sidecars' pipeline workers, not in the training
# process. Edit it and run `colocar demo` again (the keys: examples/pipeline.yaml).
source:
  kind: array_record
  paths: train-*.array_record        # relative to this file
global_batch_size: {batch}             # divides 8, 6 and 4 devices: the same after a lost host
transforms:
  - {{kind: map, fn: "colocar.demo.data:decode"}}           # bytes -> id, image, label
  - {{kind: random_map, fn: "colocar.demo.data:augment"}}   # random ink strength and pixel noise
  - {{kind: map, fn: "colocar.demo.data:normalize"}}        # pixels to float32, mean 0
seed: 0
shuffle: true
num_epochs: null                       # repeat, reshuffled every epoch
prefetch: 4
workers_per_host: 1
"""


def encode(record_id: int, image: np.ndarray, label: int) -> bytes:
    """One record as stored: id (<i4), 64 pixel bytes, label byte."""
    return np.int32(record_id).astype("<i4").tobytes() + image.astype(np.uint8).tobytes() + bytes([label])


def decode(record: bytes) -> dict[str, Any]:
    """kind: map. Raw bytes -> {"id": int32, "image": uint8 (8, 8), "label": int32}."""
    buf = np.frombuffer(record, dtype=np.uint8)
    if buf.size != RECORD_BYTES:
        raise ValueError(f"a digits record has {RECORD_BYTES} bytes, got {buf.size}")
    return {
        "id": buf[:4].view("<i4")[0].astype(np.int32),
        "image": buf[4:68].reshape(8, 8),
        "label": np.int32(buf[68]),
    }


def augment(record: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
    """kind: random_map. Ink strength scaled by 0.8..1.2 and each pixel nudged by -1, 0 or 1
    (clipped to 0..16). `rng` is seeded from (seed, record index): a replayed record, after a
    recovery, gets the same noise."""
    image = record["image"].astype(np.float32) * rng.uniform(0.8, 1.2)
    image += rng.integers(-1, 2, size=image.shape)
    return {**record, "image": np.clip(np.rint(image), 0, 16).astype(np.uint8)}


def normalize(record: dict[str, Any]) -> dict[str, Any]:
    """kind: map. Pixels 0..16 -> float32 with mean about 0 and spread about 1, flattened."""
    image = (record["image"].astype(np.float32) - 5.0) / 6.0
    return {**record, "image": image.reshape(64)}


def test_arrays(image: np.ndarray) -> np.ndarray:
    """The same normalisation, for the controller's test-set evaluation."""
    return ((image.astype(np.float32) - 5.0) / 6.0).reshape(len(image), 64)


def _write_shards(directory: str, prefix: str, images: np.ndarray, labels: np.ndarray, shards: int) -> None:
    from array_record.python.array_record_module import ArrayRecordWriter

    bounds = np.linspace(0, len(images), shards + 1).astype(int)
    for s in range(shards):
        writer = ArrayRecordWriter(os.path.join(directory, f"{prefix}-{s:05d}.array_record"), "group_size:1")
        for i in range(bounds[s], bounds[s + 1]):
            writer.write(encode(i, images[i], int(labels[i])))
        writer.close()


def write(directory: str, batch: int, test_fraction: float = 0.2, shards: int = 4) -> dict[str, Any]:
    """Writes train and test shards and `pipeline.yaml` into `directory` (kept when it exists:
    the user may have edited it). Returns paths and sizes."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = digits.images.astype(np.uint8)
    train_x, test_x, train_y, test_y = train_test_split(
        images, digits.target, test_size=test_fraction, random_state=0, stratify=digits.target
    )
    os.makedirs(directory, exist_ok=True)
    _write_shards(directory, "train", train_x, train_y, shards)
    _write_shards(directory, "test", test_x, test_y, 1)
    config = os.path.join(directory, "pipeline.yaml")
    if not os.path.exists(config):
        with open(config, "w") as f:
            f.write(PIPELINE_YAML.format(batch=batch))
    return {"config": config, "train": len(train_x), "test": len(test_x)}


def read_test(directory: str) -> tuple[np.ndarray, np.ndarray]:
    """The test shard, decoded and normalised: (images (n, 64) float32, labels (n,) int32)."""
    from array_record.python.array_record_module import ArrayRecordReader

    reader = ArrayRecordReader(os.path.join(directory, "test-00000.array_record"))
    try:
        records = [decode(r) for r in reader.read_all()]
    finally:
        reader.close()
    images = np.stack([r["image"] for r in records])
    return test_arrays(images), np.array([r["label"] for r in records], np.int32)
