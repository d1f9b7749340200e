"""Starting a pipeline's host parts: every host's `LoaderHost` and feed, all hosts at once.

Each host's start is a call to its sidecar that starts worker processes there (a forkserver's
fork, the source opened) and, on the same host, a feed socket: done one host after the other,
a pipeline on N hosts waited N times for it. The hosts start in threads of their own; the first
failure (in host order) is raised once every start has ended, and the parts that did start are
closed, so a failed start leaves nothing running.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .feed import open_feed


def _start_one(make: Callable[..., Any], plan: Any, config: Any, start: int, starve: float) -> tuple:
    host, layout, placed = plan
    obj = make(host)(config, layout, start, host.name, starve)
    try:
        return obj, open_feed(obj, host, layout, placed)
    except BaseException:
        _close_quietly(obj)
        raise


def _close_quietly(obj: Any) -> None:
    try:
        obj.close()
    except Exception:  # noqa: BLE001 - a lost host: its session's lease frees everything
        pass


def open_hosts(
    make: Callable[[Any], Any], plans: list[Any], config: Any, start: int, starve_timeout: float
) -> tuple[list[Any], list[Any]]:
    """Every host's remote `LoaderHost` (`make(host)` is its constructor there) and its feed
    (or None), in the order of `plans`, started in parallel."""
    if len(plans) == 1:
        obj, feed = _start_one(make, plans[0], config, start, starve_timeout)
        return [obj], [feed]
    with ThreadPoolExecutor(len(plans), thread_name_prefix="colocar-loader-start") as pool:
        futures = [pool.submit(_start_one, make, p, config, start, starve_timeout) for p in plans]
        outcomes = [f.exception() or f.result() for f in futures]
    failures = [o for o in outcomes if isinstance(o, BaseException)]
    if failures:
        for outcome in outcomes:
            if not isinstance(outcome, BaseException):
                obj, feed = outcome
                if feed is not None:
                    feed.close()
                _close_quietly(obj)
        raise failures[0]
    started = [o for o in outcomes if not isinstance(o, BaseException)]
    return [obj for obj, _ in started], [feed for _, feed in started]
