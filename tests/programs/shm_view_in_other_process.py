"""Attaches to an arena, prints the sum of a 4x4 bfloat16 view and sets its [0, 1] to 5.

Run by test_shm.py; argv: arena path, size, nonce, the view's offset.
"""

import sys

import ml_dtypes
import numpy as np

from colocar.shm import Arena, ndarray_view

path, size, nonce, offset = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
a = Arena.attach(path, size, nonce)
v = ndarray_view(a, offset, (4, 4), ml_dtypes.bfloat16)
print(float(v.astype(np.float32).sum()))
v[0, 1] = 5
