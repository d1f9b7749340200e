"""A save whose trainer went away before handing over its part fails at once (runs in the sidecar).

A writer's job waits for pieces until its trainer says how many it sent (`finish`). A trainer
process killed mid-save (OOM, a lost machine) never says it: the job would hold the step open,
and every other process would wait `commit_timeout` for this host's done marker. The sidecar
knows sooner: the trainer's session ends (its lease lapses a few seconds after the last sign of
life). A job records the session of the call that began it (`caller`), and `watch_caller`
tells the writer when that session ends, so that it can fail the jobs the session left
unfinished, writing the host's failure marker, which the committing writer and the other
processes see within a poll.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

from colocar.sidecar import sessions


def caller() -> str:
    """The id of the session whose call this thread serves ("" outside a sidecar call)."""
    session = sessions.current()
    return "" if session is None else session.id


def watch_caller(gone: Callable[[str, str], None]) -> None:
    """Arranges `gone(session id, why)` (a writer's bound method) for when the session whose
    call this thread serves ends (at once, on another thread, if it has ended already).
    The session holds the writer weakly: a deleted writer is not kept alive by it."""
    session = sessions.current()
    if session is None:
        return
    method = weakref.WeakMethod(gone)  # type: ignore[arg-type]

    def ended(s: sessions.Session) -> None:
        target = method()
        if target is not None:  # storage writes follow: not on the reaper's thread
            args = (s.id, _why(s))
            threading.Thread(target=target, args=args, name="colocar-ckpt-orphan", daemon=True).start()

    session.on_end(f"colocar.checkpoint.writer/{id(getattr(gone, '__self__', gone))}", ended)


def _why(session: sessions.Session) -> str:
    """How the trainer went away, as the failure marker says it."""
    who = f"the trainer process ({session.controller})" if session.controller else "the trainer process"
    if session.ended == sessions.LAPSED:
        return (
            f"{who} went away before handing over its part: its session lapsed after "
            f"{session.lease_seconds:g} s without a sign of life (killed, hung or cut off)"
        )
    if session.ended == sessions.STOPPED:
        return f"this sidecar shut down before {who} had handed over its part"
    if session.ended == sessions.TAKEN_OVER:
        return f"another controller took the session of {who} over before it had handed over its part"
    return f"{who} disconnected before handing over its part"
