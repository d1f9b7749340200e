"""Flow control of a streamed call (`Stream`): the controller's credits and its stop.

The controller grants credits (items it has room for) and may ask the stream to stop; a thread
reads its messages while the generator produces. A producer waits for a credit before each item.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from colocar.protocol import colocar_pb2 as pb


class Credits:
    """The credits a stream's controller granted, read from its messages in a thread."""

    def __init__(self, initial: int, messages: Iterator[pb.StreamRequest]):
        self._credits = threading.Semaphore(initial)
        self.ended = threading.Event()  # the controller went away: produce no more
        self._stop = threading.Event()  # the controller asked to end: finish with `done`
        threading.Thread(target=self._read, args=(messages,), daemon=True, name="colocar-credits").start()

    def _read(self, messages: Iterator[pb.StreamRequest]) -> None:
        try:
            for message in messages:
                if message.stop:
                    self._stop.set()
                    self._credits.release()
                for _ in range(message.credits):
                    self._credits.release()
        except Exception:
            pass
        self.end()

    def end(self) -> None:
        """The stream is over for the controller (its messages ended, or the RPC did)."""
        self.ended.set()
        self._credits.release()

    def take(self) -> bool:
        """Waits for a credit; False if the controller asked to stop instead."""
        self._credits.acquire()
        return not self._stop.is_set()


def chain(first: Any, rest: Iterator[Any]) -> Iterator[Any]:
    yield first
    yield from rest
