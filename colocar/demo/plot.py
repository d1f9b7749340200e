"""The demo's plot: loss and step time against step, with the run's events marked (matplotlib).

Runs in the controller, after the run; writes a PNG with the Agg backend (no display needed).
"""

from __future__ import annotations

from typing import Any

MARKS = {  # event kind -> (colour, line style, label)
    "save": ("tab:cyan", ":", "checkpoint save"),
    "kill": ("tab:red", "-", "host killed"),
    "restart": ("tab:purple", "-", "host restarted"),
    "recovery": ("tab:green", "--", "resumed from the restored step"),
    "scale_up": ("tab:blue", "-.", "host back (scale-up)"),
}


def _smooth(values: list[float], width: int = 10) -> list[float]:
    """The running mean of the last `width` values (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - width] if i >= width else 0.0)
        out.append(total / min(i + 1, width))
    return out


def draw(path: str, steps: list[Any], events: list[dict[str, Any]], title: str) -> None:
    """Loss (top) and step time in ms (bottom) per step; a later attempt's replayed steps in
    their own colour; snapshots as ticks, saves, the kill, recovery and scale-up as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True)
    restores = [e for e in events if e["kind"] == "restore" and e["hosts"]]  # one per attempt
    for attempt in sorted({s.attempt for s in steps}):
        mine = [s for s in steps if s.attempt == attempt]
        label = f"attempt {attempt}"
        if attempt <= len(restores):
            restore = restores[attempt - 1]
            label += f": {len(restore['hosts'])} hosts, {restore['detail']}"
        line = top.plot([s.step for s in mine], [s.loss for s in mine], lw=0.6, alpha=0.35)[0]
        top.plot(
            [s.step for s in mine],
            _smooth([s.loss for s in mine]),
            lw=1.6,
            color=line.get_color(),
            label=label,
        )
        bottom.plot([s.step for s in mine], [s.seconds * 1000 for s in mine], lw=0.8, label=label)
    snaps = [e["step"] for e in events if e["kind"] == "snapshot" and e["step"] is not None]
    if snaps:
        bottom.plot(snaps, [0] * len(snaps), "|", color="gray", ms=8, label="snapshot (RAM)")
    seen: set[str] = set()
    for event in events:
        mark = MARKS.get(event["detail"] if event["kind"] == "fault" else event["kind"])
        if mark is None or event["step"] is None:
            continue
        colour, style, label = mark
        first = label not in seen
        seen.add(label)
        for axis in (top, bottom):
            axis.axvline(event["step"], color=colour, ls=style, lw=1.2, label=label if first else None)
    top.set_yscale("log")
    top.set_ylabel("training loss (mean of 10 steps)")
    top.set_title(title)
    top.legend(loc="upper right", fontsize=8)
    bottom.set_ylabel("step time (ms)")
    bottom.set_xlabel("step")
    times = sorted(s.seconds * 1000 for s in steps if s.seconds == s.seconds)  # nan: an attempt's first
    if times:  # the first steps of an attempt compile: keep the scale for the others
        bottom.set_ylim(0, 2.5 * times[int(0.9 * (len(times) - 1))])
    bottom.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
