"""`colocar examples write-data DIR`: the ArrayRecord files that `examples/pipeline.yaml` reads.

The example config's source is `data/*.array_record` next to it, and nothing else writes those
files; this writes a small, seeded set (random 224x224x3 images, labels 0..9, every 16th record
unlabelled, -1, so the config's filter has something to drop) in the record format of
`examples/pipeline_transforms.py`: the image's bytes, then the label as a little-endian int32.
It lives in the package (not in examples/) so that it runs from an installed wheel too.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from colocar.cli_help import HelpFormatter

IMAGE_SHAPE = (224, 224, 3)  # examples/pipeline.yaml's element_spec
UNLABELLED_EVERY = 16


def encode(image: np.ndarray, label: int) -> bytes:
    """One record, as `pipeline_transforms.encode` makes it (that module is not in the package)."""
    return image.astype(np.uint8).tobytes() + np.int32(label).astype("<i4").tobytes()


def write(directory: str, records: int = 256, shards: int = 4, seed: int = 0) -> list[str]:
    """Writes `records` records into `shards` files `train-0000S.array_record` in `directory`
    (created if missing); returns their paths. The same arguments write the same bytes."""
    from array_record.python.array_record_module import ArrayRecordWriter

    if records < 1 or not 1 <= shards <= records:
        raise ValueError(f"need records >= 1 and 1 <= shards <= records, got {records} and {shards}")
    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(seed)
    bounds = np.linspace(0, records, shards + 1).astype(int)
    paths = []
    for s in range(shards):
        path = os.path.join(directory, f"train-{s:05d}.array_record")
        writer = ArrayRecordWriter(path, "group_size:1")
        for i in range(bounds[s], bounds[s + 1]):
            label = -1 if i % UNLABELLED_EVERY == UNLABELLED_EVERY - 1 else i % 10
            writer.write(encode(rng.integers(0, 256, IMAGE_SHAPE, dtype=np.uint8), label))
        writer.close()
        paths.append(path)
    return paths


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="colocar examples", description=__doc__, formatter_class=HelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    w = sub.add_parser(
        "write-data",
        help="write the ArrayRecord files examples/pipeline.yaml reads",
        formatter_class=HelpFormatter,
    )
    w.add_argument("dir", help="where to write them: examples/data for examples/pipeline.yaml")
    w.add_argument("--records", type=int, default=256, help="number of records")
    w.add_argument("--shards", type=int, default=4, help="number of files")
    w.add_argument("--seed", type=int, default=0, help="seeds the images")
    return p


def main(argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
    try:
        paths = write(args.dir, args.records, args.shards, args.seed)
    except ValueError as e:
        print(f"colocar examples write-data: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"wrote {args.records} records to {len(paths)} files in {args.dir}", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
