"""Controller sessions on the sidecar and the lease that keeps their objects and blocks alive.

A controller opens a session at connect and renews it with keepalives (and with every call).
When a lease runs out (controller killed, disconnected or partitioned), `on_expire` frees
everything the session owned. A reaper thread checks a few times per lease; the time the
sidecar's process did not run (stopped, or its GIL held) does not count against a lease.

A **named** session (`connect(..., session="exp1")`) outlives its controller: when the lease
runs out it is only *detached*, and keeps what it holds for its grace period. Its controller
coming back (a laptop waking up) finds it as it was; a new controller connecting under the same
name takes it over (`open` returns the previous session, which the service then ends as
TAKEN_OVER, moving its named objects to the new one). An id taken over, or closed from outside
(`colocar sessions close`), is remembered: its old controller is told why, and never silently
gets a new session under it.

Shipped code that must outlive its call but not its controller (a checkpoint writer's save in
progress) finds the session it serves with `current()` and asks to hear when its controller is
gone with `Session.on_end` (a lapse, a close, a takeover: also when a named session is only
detached).
"""

from __future__ import annotations

import collections
import queue
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

LOG_QUEUE_LINES = 10_000
# how a session's controller went away (`Session.ended`)
LAPSED, CLOSED, STOPPED, TAKEN_OVER = "lapsed", "closed", "stopped", "taken over"
ENDED_KEPT = 1024  # ids taken over or closed from outside, remembered to tell their controllers
STALL_FORGIVEN_AFTER = 0.2  # seconds the reaper woke late by: the process did not run

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
            return 0.0 if session.detached else max(0.0, session.expires_at - time.monotonic())
    return None


class SessionGone(Exception):
    """A request names a session that was taken over or closed from outside (the message says
    which, and by whom)."""


@dataclass
class Session:
    id: str
    controller: str
    lease_seconds: float
    expires_at: float  # the controller's lease
    name: str = ""  # a named session outlives its controller for `grace_seconds`
    grace_seconds: float = 0.0
    mapping: int = 0  # the controller's mapping of the arena (its address), once it said so
    detached_at: float | None = None  # its controller's lease ran out (named sessions only)
    logs: queue.Queue = field(default_factory=lambda: queue.Queue(LOG_QUEUE_LINES))
    dropped_log_lines: int = 0
    reported_dropped_lines: int = 0  # of dropped_log_lines, those take_lines already reported
    closed: bool = False
    ended: str = ""  # how its controller went: LAPSED, CLOSED, STOPPED or TAKEN_OVER
    _end_hooks: dict[str, Callable[[Session], None]] = field(default_factory=dict, init=False, repr=False)
    _hooks_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    @property
    def detached(self) -> bool:
        return self.detached_at is not None

    def on_end(self, key: str, callback: Callable[[Session], None]) -> None:
        """Calls `callback(session)` once the session's controller is gone: the session ended,
        or a named one was detached (at once if that happened); one callback per `key`
        (registering a key again replaces it). It runs on the reaper's or the closer's thread,
        so it must be quick (start a thread for slow work)."""
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
        """A sign of life of its controller: the lease starts again, a detached session is
        attached again (its controller came back)."""
        self.expires_at = time.monotonic() + self.lease_seconds
        if self.detached_at is not None:
            self.detached_at = None
            self.ended = ""

    def grace_left(self, now: float) -> float | None:
        """Seconds until a detached session ends (None while attached)."""
        if self.detached_at is None:
            return None
        return max(0.0, self.detached_at + self.grace_seconds - now)

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
    """Thread-safe table of sessions with lease expiry, named sessions and their grace."""

    def __init__(
        self, default_lease: float, on_expire: Callable[[Session, str], None], default_grace: float = 0.0
    ):
        self.default_lease = default_lease
        self.default_grace = default_grace
        self._on_expire = on_expire
        self._sessions: dict[str, Session] = {}
        self._named: dict[str, Session] = {}
        self._gone: collections.OrderedDict[str, str] = collections.OrderedDict()  # id -> why
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap, name="colocar-reaper", daemon=True)
        self._reaper.start()
        _TABLES.add(self)

    def open(
        self, session_id: str, controller: str, lease_seconds: float, name: str = "", grace: float = 0.0
    ) -> tuple[Session, Session | None]:
        """Opens (or renews) a session; returns it, and the session it took over: the one of
        another controller under the same `name`, which the caller must end (TAKEN_OVER).
        Raises `SessionGone` for an id that was taken over or closed from outside."""
        lease = lease_seconds if lease_seconds > 0 else self.default_lease
        with self._lock:
            self._check_not_gone(session_id)
            session = self._sessions.get(session_id)
            previous = None
            if session is None:
                session = Session(session_id, controller, lease, 0.0, name=name)
                self._sessions[session_id] = session
                if name:
                    previous = self._named.get(name)
                    if previous is not None:
                        self._forget(previous, f"session {name!r} was taken over by controller {controller}")
                    self._named[name] = session
            session.lease_seconds = lease
            session.grace_seconds = (grace if grace > 0 else self.default_grace) if session.name else 0.0
            session.renew()
            return session, previous

    def get(self, session_id: str) -> Session | None:
        """The live session (renewed, since any request is a sign of life), or None; raises
        `SessionGone` for an id taken over or closed from outside."""
        session = self._sessions.get(session_id)
        if session is not None:
            session.renew()
        elif session_id in self._gone:
            with self._lock:
                self._check_not_gone(session_id)
        _serving.session = session
        return session

    def _check_not_gone(self, session_id: str) -> None:
        why = self._gone.get(session_id)
        if why is not None:
            raise SessionGone(why)

    def close(self, session_id: str) -> None:
        """Its controller ends the session (Disconnect)."""
        with self._lock:
            session = self._sessions.get(session_id)
            if session is not None:
                self._forget(session)
        if session is not None:
            self._expire(session, CLOSED)

    def close_from_outside(self, selector: str, by: str) -> list[Session]:
        """Ends the sessions whose name is `selector`, or whose id starts with it (at least 8
        characters); their controllers are told who closed them. Returns them."""
        with self._lock:
            found = [
                s
                for s in self._sessions.values()
                if selector and (s.name == selector or (len(selector) >= 8 and s.id.startswith(selector)))
            ]
            for session in found:
                self._forget(session, f"session {session.name or session.id[:8]!r} was closed by {by}")
        for session in found:
            self._expire(session, CLOSED)
        return found

    def end(self, session: Session, how: str) -> None:
        """Ends a session already taken out of the table (the one `open` took over)."""
        self._expire(session, how)

    def list(self) -> list[Session]:
        with self._lock:
            return list(self._sessions.values())

    def __len__(self) -> int:
        return len(self._sessions)

    def _forget(self, session: Session, why: str = "") -> None:
        """Takes the session out of the table (lock held); `why`: its id is remembered as gone."""
        self._sessions.pop(session.id, None)
        if session.name and self._named.get(session.name) is session:
            del self._named[session.name]
        if why:
            self._gone[session.id] = why
            while len(self._gone) > ENDED_KEPT:
                self._gone.popitem(last=False)

    def _expire(self, session: Session, how: str) -> None:
        session.closed = True
        session.log("")  # wakes a wait for log lines so it can end
        self._on_expire(session, how)
        session._run_end_hooks(how)

    def _reap(self) -> None:
        period = min(0.25, self.default_lease / 4)
        woke = time.monotonic()
        while not self._stop.wait(period):
            now = time.monotonic()
            detached: list[Session] = []
            over: list[Session] = []
            with self._lock:
                self._forgive_stall(now - woke - period)
                for session in self._sessions.values():
                    if session.detached:
                        if session.grace_left(now) == 0.0:
                            over.append(session)
                    elif session.expires_at < now:
                        (detached if session.name and session.grace_seconds > 0 else over).append(session)
                for session in detached:
                    session.detached_at = now
                for session in over:
                    self._forget(session)
            for session in detached:
                session._run_end_hooks(LAPSED)  # its controller is gone; what it holds stays
            for session in over:
                self._expire(session, LAPSED)
            woke = time.monotonic()  # the wait starts now (ending sessions may take a while)

    def _forgive_stall(self, stall: float) -> None:
        """Moves every deadline on by the time this process did not run (lock held): a
        SIGSTOP, a frozen VM, or code in the sidecar's own process holding the GIL (a first
        import of tensorstore with `processes=0`). The controllers' keepalives of that time
        wait unread on their sockets: a lease lapses only when the sidecar listened for all
        of it and heard nothing."""
        if stall < STALL_FORGIVEN_AFTER:
            return
        for session in self._sessions.values():
            session.expires_at += stall
            if session.detached_at is not None:
                session.detached_at += stall

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            sessions = list(self._sessions.values())
            self._sessions.clear()
            self._named.clear()
        for session in sessions:
            self._expire(session, STOPPED)
