"""`load(..., progress=True)`: the line shows the total when it is known, and the time left."""

from __future__ import annotations

import io

from loaders_helpers import B, N, config, take

from colocar import loaders
from colocar.loaders.progress import Progress


def test_progress_knows_the_total_of_a_bounded_pipeline(cluster, capsys) -> None:
    with loaders.load(config(num_epochs=2), cluster, progress=True) as it:
        assert it._progress is not None and it._progress.total == 2 * (N // B)
        take(it, 3)
    out = capsys.readouterr().out
    assert f"3/{2 * (N // B)}" in out and "ETA" in out, out
    with loaders.load(config(num_epochs=None), cluster, progress=True) as it:
        assert it._progress is not None and it._progress.total is None  # forever: no total
        take(it, 2)
    assert "2/?" in capsys.readouterr().out


def test_progress_line_shows_done_of_total_and_time_left() -> None:
    from rich.console import Console

    out = io.StringIO()
    bar = Progress(total=120, start=60, console=Console(file=out, force_terminal=True, width=160))
    bar.advance(62, waited=0.5)
    bar.stop()
    text = out.getvalue()
    assert "62/120" in text and "ETA" in text and "waited 0.5 s" in text, text
