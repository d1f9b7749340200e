"""What the controller tells a sidecar in the background: blocks, objects and calls it gave up.

Views dropped by the program, replies of abandoned calls, handles finalized by the garbage
collector and calls cut short all end here, batched by a `Reclaimer` thread into `Release`,
`DeleteObject` and `Cancel`. If the sidecar cannot be told, the session's lease frees them.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any, Protocol

from colocar.protocol import colocar_pb2 as pb
from colocar.protocol.status import Status, TransportError
from colocar.shm.reclaim import Reclaimer

from .transport import Transport

RETRY_SECONDS = 0.05  # before a release refused while the session reopens is sent again


class _Session(Protocol):
    session_id: str
    generation: int
    closed: bool

    @property
    def lost(self) -> Any: ...


class Releases:
    """The background queue of releases, deletes and cancels to one sidecar."""

    def __init__(
        self,
        name: str,
        session: _Session,
        transport: Transport,
    ):
        self._session = session
        self._transport = transport
        self.reclaimer = Reclaimer(self._release, name=f"colocar-release-{name}")

    def discard_reply(self, reply: Any) -> None:
        """Frees what the reply of an abandoned call carries: its blocks, a new remote object."""
        if isinstance(reply, pb.CallReply):
            blocks: Any = reply.result.blocks
            if reply.object_id:
                self.delete_object_soon(reply.object_id, self._session.generation)
        elif isinstance(reply, pb.AllocateReply):
            blocks = reply.blocks
        else:
            return
        for desc in blocks:
            self.reclaimer.push(("block", desc.id, desc.offset))

    def release_soon(self, block_ids: Iterable[int]) -> None:
        """Gives back blocks leased to the session that no call and no view holds."""
        for block_id in block_ids:
            self.reclaimer.push(("block", block_id, -1))

    def cancel_soon(self, call_id: int) -> None:
        """Asks the sidecar, in the background, to cancel a call this controller gave up on."""
        self.reclaimer.push(("cancel", call_id, 0))

    def delete_object_soon(self, object_id: int, generation: int) -> None:
        """Deletes a remote object in the background (called from handle finalizers)."""
        self.reclaimer.push(("object", object_id, generation))

    def _release(self, items: list[tuple[str, int, int]]) -> None:
        """Background: tells the sidecar which blocks and objects we no longer hold."""
        cancels = [ident for kind, ident, _ in items if kind == "cancel"]
        dropped = [ident for kind, ident, _ in items if kind == "block"]
        session = self._session
        if session.closed or session.lost is not None:
            return
        sid, call = session.session_id, self._transport.call
        try:
            if cancels:
                call("Cancel", pb.CancelRequest(session_id=sid, call_ids=cancels), 30)
            if dropped:
                call("Release", pb.ReleaseRequest(session_id=sid, block_ids=dropped), 30)
            for kind, ident, generation in items:
                if kind == "object" and generation == session.generation:
                    call("DeleteObject", pb.ObjectRef(session_id=sid, object_id=ident), 30)
        except TransportError as e:
            if dropped and e.status == Status.FAILED_PRECONDITION and not (session.closed or session.lost):
                # Refused in the moment the session is reopened under its id (a lapse, a rejoin's
                # fresh session): its blocks come back under it, so their release must too.
                time.sleep(RETRY_SECONDS)
                self.release_soon(dropped)
            # else the session's lease frees them if the sidecar cannot be told

    def flush(self, timeout: float) -> None:
        self.reclaimer.flush(timeout=timeout)

    def close(self) -> None:
        self.reclaimer.close()
