"""`python -m colocar ...`: the `colocar` command (see `colocar.cli`)."""

from colocar.cli import main

main()
