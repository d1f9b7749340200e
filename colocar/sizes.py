"""Byte sizes as every colocar flag writes them (runs anywhere; imports nothing of ours).

One syntax for all flags (`--arena-size`, `--pool`, `--shm-size`, `--sidecar-memory`): a
number, optionally followed by K, M, G or T, which may be written `G`, `Gi` or `GiB` (any
case). Units are always binary (`16G` = `16Gi` = 16 * 2**30), as for the sidecar's arena,
so the same text means the same bytes in every command. A plain number is bytes.
"""

from __future__ import annotations

import re

_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*(?:([KMGT])(?:I?B|I)?|B)?\s*$", re.IGNORECASE)
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
SYNTAX = "a number of bytes or one with K, M, G or T (binary: 16G = 16Gi = 16GiB), e.g. 512M or 16G"


def parse_size(text: str) -> int:
    """'16G', '16Gi', '16GiB', '512M', '1.5G', '4096' -> bytes; ValueError saying the syntax."""
    m = _SIZE.match(text) if isinstance(text, str) else None
    if m is None:
        raise ValueError(f"{text!r} is not a size: write {SYNTAX}")
    number, unit = m.groups()
    value = float(number) * _UNITS[unit.upper()] if unit else float(number)
    if value != int(value):
        raise ValueError(f"{text!r} is not a whole number of bytes: write {SYNTAX}")
    return int(value)
