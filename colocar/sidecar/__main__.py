"""`python -m colocar.sidecar`: run a sidecar (see `colocar.sidecar.server`)."""

from colocar.sidecar.server import main

main()
