"""Controller sessions on the sidecar and the lease that keeps their objects and blocks alive.

A controller opens a session at connect and renews it with keepalives (and with every call).
When a lease runs out (controller killed, disconnected or partitioned), `on_expire` frees
everything the session owned. A reaper thread checks a few times per lease. Shipped code that
must outlive its call but not its controller (a checkpoint writer's save in progress) finds
the session it serves with `current()` and asks to hear of its end with `Session.on_end`.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

LOG_QUEUE_LINES = 10_000
LAPSED, CLOSED, STOPPED = "lapsed", "closed", "stopped"  # how a session ended (`Session.ended`)

_serving = threading.local()  # .session: the session of the request this thread serves last
_TABLES: weakref.WeakSet[SessionTable] = weakref.WeakSet()  # this sidecar's tables (one, in practice)


def current() -> Session | None:
    """The session whose request this thread is serving (None outside a request's thread)."""
    return getattr(_serving, "session", None)


def seconds_left(session_id: str) -> float | None:
    """Seconds until the session `session_id` lapses unless its controller shows life, or None
    when this sidecar holds no such session (it ended, or never was here). Does not renew it:
    shipped code asks this about another controller (a checkpoint lease's dead holder)."""
    for table in list(_TABLES):
        session = table._sessions.get(session_id)
        if session is not None and not session.closed:
            return max(0.0, session.expires_at - time.monotonic())
    return None


@dataclass
class Session:
    id: str
    controller: str
    lease_seconds: float
    expires_at: float
    logs: queue.Queue = field(default_factory=lambda: queue.Queue(LOG_QUEUE_LINES))
    dropped_log_lines: int = 0
    reported_dropped_lines: int = 0  # of dropped_log_lines, those take_lines already reported
    closed: bool = False
    ended: str = ""  # LAPSED, CLOSED or STOPPED once it ended
    _end_hooks: dict[str, Callable[[Session], None]] = field(default_factory=dict, init=False, repr=False)
    _hooks_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def on_end(self, key: str, callback: Callable[[Session], None]) -> None:
        """Calls `callback(session)` once the session ends (at once if it has); one callback
        per `key` (registering a key again replaces it). It runs on the reaper's or the closer's
        thread, so it must be quick (start a thread for slow work)."""
        with self._hooks_lock:
            if not self.ended:
                self._end_hooks[key] = callback
                return
        callback(self)

    def _run_end_hooks(self, how: str) -> None:
        with self._hooks_lock:
            self.ended = how
            hooks, self._end_hooks = list(self._end_hooks.values()), {}
        for callback in hooks:
            try:
                callback(self)
            except Exception as e:  # one failing hook must not keep the others from running
                print(f"colocar sidecar: a hook on the end of session {self.id} failed: {e!r}", flush=True)

    def renew(self) -> None:
        self.expires_at = time.monotonic() + self.lease_seconds

    def log(self, text: str) -> None:
        try:
            self.logs.put_nowait(text)
        except queue.Full:
            self.dropped_log_lines += 1

    def take_lines(self, wait: float, stopping: Callable[[], bool], most: int) -> list[str]:
        """The pending log lines (at most `most`), waiting up to `wait` s for the first, led
        by a note when lines were dropped since the last one. Returns within half a second of
        the session closing or `stopping()`."""
        deadline = time.monotonic() + wait
        lines: list[str] = []
        while not self.closed and not stopping():
            try:
                text = self.logs.get(timeout=max(0.0, min(0.5, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() >= deadline:
                    break
                continue
            if self.closed:  # the wake-up of a closing session (an empty line)
                break
            lines.append(text)
            while len(lines) < most:
                try:
                    lines.append(self.logs.get_nowait())
                except queue.Empty:
                    break
            break
        dropped = self.dropped_log_lines - self.reported_dropped_lines
        if dropped > 0 and lines:
            self.reported_dropped_lines += dropped
            lines.insert(0, f"({dropped} log lines dropped: the controller read too slowly)")
        return lines


class SessionTable:
    """Thread-safe table of sessions with lease expiry."""

    def __init__(self, default_lease: float, on_expire: Callable[[Session, str], None]):
        self.default_lease = default_lease
        self._on_expire = on_expire
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap, name="colocar-reaper", daemon=True)
        self._reaper.start()
        _TABLES.add(self)

    def open(self, session_id: str, controller: str, lease_seconds: float) -> Session:
        lease = lease_seconds if lease_seconds > 0 else self.default_lease
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None:
                session = Session(session_id, controller, lease, 0.0)
                self._sessions[session_id] = session
            session.lease_seconds = lease
            session.renew()
            return session

    def get(self, session_id: str) -> Session | None:
        """The live session (renewed, since any request is a sign of life), or None."""
        session = self._sessions.get(session_id)
        if session is not None:
            session.renew()
        _serving.session = session
        return session

    def close(self, session_id: str) -> None:
        with self._lock:
            session = self._sessions.pop(session_id, None)
        if session is not None:
            self._expire(session, CLOSED)

    def __len__(self) -> int:
        return len(self._sessions)

    def _expire(self, session: Session, how: str) -> None:
        session.closed = True
        session.log("")  # wakes a wait for log lines so it can end
        self._on_expire(session, how)
        session._run_end_hooks(how)

    def _reap(self) -> None:
        while not self._stop.wait(min(0.25, self.default_lease / 4)):
            now = time.monotonic()
            with self._lock:
                expired = [s for s in self._sessions.values() if s.expires_at < now]
                for session in expired:
                    del self._sessions[session.id]
            for session in expired:
                self._expire(session, LAPSED)

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            sessions = list(self._sessions.values())
            self._sessions.clear()
        for session in sessions:
            self._expire(session, STOPPED)
