"""colocar benchmarks: each module has `run(quick, repeats) -> dict`; see `benchmarks.run`."""
