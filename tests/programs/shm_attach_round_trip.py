"""Attaches to an arena, prints 5 bytes at the header's end and writes b"abc" 100 bytes later.

Run by test_shm.py; argv: arena path, size, nonce, header bytes.
"""

import sys

from colocar.shm import Arena

path, size, nonce, header = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
a = Arena.attach(path, size, nonce)
print(bytes(a.buffer(header, 5)).decode())
a.buffer(header + 100, 3)[:] = b"abc"
a.close()
