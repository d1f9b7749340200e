"""Creates an arena in a directory, prints its path and lives until killed.

Run by test_shm.py; argv: the directory.
"""

import sys
import time

from colocar.shm import Arena

a = Arena.create(sys.argv[1], 1 << 20, label="child")
print(a.path, flush=True)
time.sleep(120)
