"""Example per-record transforms for `examples/pipeline.yaml`.

Each record of the example ArrayRecord files is raw bytes: a 224x224x3 uint8 image followed by a
little-endian int32 label (see `encode`). The config names these functions as
``pipeline_transforms:decode`` etc., so this module must be importable by that name in the
controller and on the sidecars (which run with the controller's sys.path): put ``examples/`` on
``PYTHONPATH`` or ``sys.path``, or install your own transforms as a package. The example data
(`data/*.array_record` next to the config) comes from ``colocar examples write-data examples/data``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

IMAGE_SHAPE = (224, 224, 3)
IMAGE_BYTES = 224 * 224 * 3


def encode(image: np.ndarray, label: int) -> bytes:
    """One record as written to the ArrayRecord files: image bytes, then the label as <i4."""
    assert image.shape == IMAGE_SHAPE and image.dtype == np.uint8
    return image.tobytes() + np.int32(label).astype("<i4").tobytes()


def decode(record: bytes) -> dict[str, Any]:
    """kind: map. Raw bytes -> {"image": uint8 (224, 224, 3), "label": int32 scalar}."""
    buf = np.frombuffer(record, dtype=np.uint8)
    if buf.size != IMAGE_BYTES + 4:
        raise ValueError(f"expected a record of {IMAGE_BYTES + 4} bytes, got {buf.size}")
    image = buf[:IMAGE_BYTES].reshape(IMAGE_SHAPE)
    label = buf[IMAGE_BYTES:].view("<i4")[0].astype(np.int32)
    return {"image": image, "label": label}


def has_label(record: dict[str, Any]) -> bool:
    """kind: filter. Drops records labelled -1 (unlabelled)."""
    return bool(record["label"] >= 0)


def augment(record: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
    """kind: random_map. A random horizontal flip; `rng` is seeded from (seed, record index)."""
    image = record["image"]
    if rng.random() < 0.5:
        image = image[:, ::-1, :]
    return {**record, "image": image}
