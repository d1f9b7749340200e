"""The demo's live display (rich): a progress line with step, loss and examples/s, and a line
for each snapshot, save, fault, loss, recovery and scale-up as it happens; then the summary.

Runs in the controller. On a terminal the progress line refreshes in place; in a log (not a
tty) rich prints plain lines instead.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

STYLE = {
    "snapshot": "dim",
    "replication": "dim",
    "save": "cyan",
    "restore": "green",
    "fault": "bold red",
    "loss": "red",
    "recovery": "bold green",
    "scale_up": "bold blue",
}


class Display:
    """Progress and events of one run, on `console` (default: stdout)."""

    def __init__(self, steps: int, console: Console | None = None, every: int = 1):
        self.console = console or Console()
        self.every = every  # print one step line in `every` when not on a terminal
        self.progress = Progress(
            TextColumn("[bold]train[/]"),
            BarColumn(),
            TextColumn("step {task.completed:>4.0f}/{task.total:.0f}"),
            TextColumn("loss {task.fields[loss]:.4f}"),
            TextColumn("{task.fields[rate]:>7.0f} ex/s"),
            TimeElapsedColumn(),
            console=self.console,
        )
        self.task = self.progress.add_task("train", total=steps, loss=float("nan"), rate=0.0)

    def __enter__(self) -> Display:
        self.progress.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.progress.stop()

    def note(self, text: str) -> None:
        self.console.print(text)

    def step(self, record: Any, batch: int) -> None:
        rate = batch / record.seconds if record.seconds > 0 else 0.0
        self.progress.update(self.task, completed=record.step + 1, loss=record.loss, rate=rate)
        if not self.console.is_terminal and record.step % self.every == 0:
            self.console.print(f"step {record.step:4d}  loss {record.loss:.4f}  {rate:7.0f} ex/s")

    def event(self, event: dict[str, Any]) -> None:
        kind = event["kind"]
        if kind == "replication":
            return  # one per snapshot, in the background: the snapshot line says enough
        hosts = f" [{', '.join(event['hosts'])}]" if event["hosts"] and kind != "snapshot" else ""
        detail = f": {event['detail']}" if event["detail"] else ""
        took = f" {event['seconds'] * 1000:.0f} ms" if event["seconds"] else ""
        style = STYLE.get(kind, "")
        line = f"{kind:>9} at step {event['step']}{took}{hosts}{detail}"
        self.console.print(Text(line[:160], style=style))

    def summary(self, rows: list[tuple[str, str]], ok: bool) -> None:
        table = Table(title="colocar demo: summary", show_header=False)
        table.add_column(style="bold")
        table.add_column()
        for name, value in rows:
            table.add_row(name, value)
        self.console.print(table)
        self.console.print("[bold green]demo passed[/]" if ok else "[bold red]demo FAILED[/]")
