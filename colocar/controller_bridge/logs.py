"""Prints what shipped functions print, prefixed with their host (runs in the controller).

One thread per host long-polls the session's log lines (`PollLogs`: one call waits until lines
come) over whichever transport the calls take: the local link's thread sleeps in one socket
read, gRPC's in one pending call.
"""

from __future__ import annotations

import sys
import threading

from colocar.protocol import colocar_pb2 as pb
from colocar.protocol.status import TransportError

from .session import Session
from .transport import Transport

LOG_POLL_SECONDS = 30.0  # longest wait of one PollLogs call for log lines


class LogForwarder:
    """The thread that forwards one session's log lines to stdout while the session is open."""

    def __init__(self, session: Session, transport: Transport):
        self._session = session
        self._transport = transport
        self._thread = threading.Thread(target=self._run, name=f"colocar-logs-{session.name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        session = self._session
        prefix = f"[{session.name}] "
        request = pb.LogPoll(session_id=session.session_id, wait_seconds=LOG_POLL_SECONDS)
        while not session.closed:
            try:
                reply = self._transport.call("PollLogs", request, LOG_POLL_SECONDS + 30)
            except TransportError:  # lost, restarted or closing: look again after a heartbeat
                if session.wait_closed(session.heartbeat_seconds):
                    return
                continue
            except ValueError:  # the channel was closed under us
                return
            for text in reply.lines:
                _print_line(prefix + text)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout=timeout)


def _print_line(text: str) -> None:
    """One forwarded line to stdout, in one write: `print` writes the line and its newline
    separately, and on a write-through stdout (unbuffered, pytest's capture) another thread's
    write can land between the two. A stdout closed or replaced meanwhile costs that line, never
    the forwarding thread."""
    try:
        out = sys.stdout
        out.write(text + "\n")
        out.flush()
    except (ValueError, OSError):
        pass
