"""The controller's link to one sidecar: session, keepalive, ordered calls and bulk data.

Runs in the controller (device owner). One `HostConnection` per sidecar holds the gRPC channel,
the session (renewed by the cluster's heartbeat), the set of code hashes the sidecar already has,
and its arena client (`arena_client.py`): the sidecar's arena mapped here when it is reachable
(same host, same shm dir), else chunked gRPC streams.

Calls from one controller thread to one host run in program order: each (thread, host) pair has
a lane, and a call is sent only when the lane's previous call has completed or was abandoned.

A call cut short (an interrupt, a timeout, `future.cancel()`) is abandoned: its lane goes on at
once, the sidecar is asked to cancel it, and its reply, if one still comes, is read in the
background and freed (`discard_reply`), never handed to another call.
"""

from __future__ import annotations

import collections
import functools
import itertools
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, InvalidStateError, ThreadPoolExecutor
from typing import Any

import grpc
import numpy as np

from colocar.errors import (
    AuthError,
    CallTimeoutError,
    ColocarError,
    HostLostError,
    VersionSkewError,
)
from colocar.protocol import colocar_pb2 as pb
from colocar.protocol import colocar_pb2_grpc as pb_grpc
from colocar.protocol import versions
from colocar.protocol.link import METHODS as LINK_METHODS
from colocar.protocol.tokens import TOKEN_METADATA_KEY
from colocar.shm import Arena, ArenaFullError
from colocar.shm.reclaim import Reclaimer

from .arena_client import ArenaClient, run_stream
from .link_client import LinkClient, LinkError

MiB = 1 << 20
LOST_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
LINK_THREADS = 16  # futures in flight at once over one host's local link
LOG_POLL_SECONDS = 30.0  # longest wait of one PollLogs call for log lines


def channel_options(heartbeat_seconds: float) -> list[tuple[str, Any]]:
    """gRPC keepalive pings detect a dead or stopped sidecar even in the middle of a call
    (calls waiting on the local link learn it from the heartbeat)."""
    ping_ms = max(200, int(heartbeat_seconds * 1000))
    return [
        ("grpc.max_receive_message_length", 64 * MiB),
        ("grpc.max_send_message_length", 64 * MiB),
        ("grpc.keepalive_time_ms", ping_ms),
        ("grpc.keepalive_timeout_ms", 2 * ping_ms),
        # gRPC >= 1.57 waits for ping acks this long (default 1 min), whatever keepalive_timeout says
        ("grpc.http2.ping_timeout_ms", 2 * ping_ms),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.enable_retries", 0),
        # Without calls for this long the channel drops its connection: an idle connected
        # channel keeps gRPC's event-engine threads waking (~1 ms of CPU per second per
        # channel). With a local link gRPC carries only streams (and, rarely, a reconnect), so
        # it is idle nearly always; without one, the log stream and heartbeats keep it open.
        ("grpc.client_idle_timeout_ms", max(1000, ping_ms)),
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ]


class LaneFuture(Future):
    """The future of a call in its lane (see `HostConnection.submit`).

    `abandon()` gives up on a call that was sent: the future raises CancelledError and the
    lane's next call goes at once. The lane moves on once per call, whichever comes first.
    """

    def __init__(self, send: Callable[[], Any], unsent: Callable[[], None] | None):
        super().__init__()
        self.send = send
        self.unsent = unsent  # runs if the call is cancelled before it was sent
        self.next: Callable[[], None] = lambda: None
        self._moved_on = threading.Lock()

    def move_lane_on(self) -> None:
        if self._moved_on.acquire(blocking=False):
            self.next()

    def abandon(self) -> bool:
        """Cancels a queued call, or resolves a running one as cancelled and frees its lane;
        False if it had finished."""
        if self.cancel():
            return True
        if not settle(self.set_exception, CancelledError("the call was abandoned")):
            return False
        self.move_lane_on()
        return True


def settle(set_outcome: Callable[[Any], None], value: Any) -> bool:
    """Sets a future's outcome; False if it already had one (an abandoned call's late reply)."""
    try:
        set_outcome(value)
    except InvalidStateError:
        return False
    return True


class _Lane:
    __slots__ = ("pending", "busy")

    def __init__(self) -> None:
        self.pending: collections.deque[LaneFuture] = collections.deque()
        self.busy = False


class HostConnection:
    """A session with one sidecar, and the transport of calls and arrays to it."""

    def __init__(
        self,
        address: str,
        name: str,
        token: str | None,
        *,
        shm: bool = True,
        lease_seconds: float = 30.0,
        heartbeat_seconds: float = 1.0,
        connect_timeout: float = 30.0,
        alloc_timeout: float = 30.0,
        credentials: grpc.ChannelCredentials | None = None,
        process_status: Callable[[], str | None] | None = None,
    ):
        self.address = address
        self.name = name
        self.lease_seconds = lease_seconds
        self.heartbeat_seconds = heartbeat_seconds
        self._token = token or ""
        self.metadata = ((TOKEN_METADATA_KEY, self._token),)
        self.link: LinkClient | None = None
        self._link_executor: ThreadPoolExecutor | None = None
        options = channel_options(heartbeat_seconds)
        if credentials is not None:
            self.channel = grpc.secure_channel(address, credentials, options=options)
        else:
            self.channel = grpc.insecure_channel(address, options=options)
        self.stub = pb_grpc.SidecarStub(self.channel)
        self.session_id = uuid.uuid4().hex
        self.lost: HostLostError | None = None
        self.unresponsive = False  # no answer at all, not even a refusal
        self.generation = 0  # bumped at every (re)connect: remote objects of older ones are gone
        self.known_code: set[bytes] = set()
        stream = functools.partial(run_stream, self.stub, self.metadata, self.check_alive, self.translate)
        self.arenas = ArenaClient(
            self.session_id, shm, alloc_timeout, self.unary, stream, release_soon=self.release_soon
        )
        self._lanes: dict[int, _Lane] = {}
        self._lanes_lock = threading.Lock()
        self._call_ids = itertools.count(1)
        self._reclaimer = Reclaimer(self._release, name=f"colocar-release-{name}")
        self._closed = False
        try:
            self.info = self._connect(connect_timeout)
        except BaseException:  # refused (token, version skew) or unreachable: leave nothing behind
            self._reclaimer.close()
            self.channel.close()
            raise
        self._log_thread = threading.Thread(
            target=self._forward_logs, name=f"colocar-logs-{name}", daemon=True
        )
        self._log_thread.start()
        self._process_status = process_status
        self._stop = threading.Event()
        self.alive_at = 0.0  # monotonic time the sidecar last proved alive (a keepalive, a batch fed)
        self._renewed_at = time.monotonic()  # the session's lease was last renewed
        self._heartbeat_thread = threading.Thread(
            target=self._heartbeat_loop, name=f"colocar-heartbeat-{name}", daemon=True
        )
        self._heartbeat_thread.start()

    def _heartbeat_loop(self) -> None:
        """A keepalive every heartbeat period, except while other traffic (a batch feed) shows
        the sidecar alive: then only often enough to renew the session's lease. Once that
        traffic stops, keepalives resume within two periods."""
        while not self._stop.wait(self.heartbeat_seconds):
            reason = self._process_status() if self._process_status else None
            if reason is not None:
                self.unresponsive = True
                self.mark_lost(reason)
                return
            now = time.monotonic()
            proven = now - self.alive_at < self.heartbeat_seconds
            if proven and now - self._renewed_at < self.lease_seconds / 3:
                continue
            self.heartbeat()

    # --- session ---------------------------------------------------------------------------
    def _connect(self, timeout: float) -> pb.ConnectReply:
        local = versions.local_versions()
        request = pb.ConnectRequest(
            session_id=self.session_id,
            python_version=local["python"],
            cloudpickle_version=local["cloudpickle"],
            jax_version=local["jax"],
            sys_path=[p for p in sys.path if p],
            cwd=os.getcwd(),
            lease_seconds=self.lease_seconds,
            controller=f"{socket.gethostname()}:{os.getpid()}",
        )
        try:
            reply = self.stub.Connect(request, metadata=self.metadata, timeout=timeout, wait_for_ready=True)
        except grpc.RpcError as e:
            raise self._connect_error(e) from None
        self.generation += 1
        self.known_code.clear()
        self.lost = None
        self.unresponsive = False
        self.arenas.attach(reply)
        if self.link is not None:
            self.link.close()
            self.link = None
        if self.arena is not None and reply.link_path:
            try:
                self.link = LinkClient(
                    reply.link_path, self._token, lambda: self.unresponsive, self.heartbeat_seconds
                )
            except (OSError, grpc.RpcError):
                self.link = None  # not reachable from here: every call goes through gRPC
        return reply

    def link_executor(self) -> ThreadPoolExecutor:
        """Threads that carry futures over the local link (each has its own socket)."""
        with self._lanes_lock:
            if self._link_executor is None:
                self._link_executor = ThreadPoolExecutor(
                    max_workers=LINK_THREADS, thread_name_prefix=f"colocar-link-{self.name}"
                )
            return self._link_executor

    def sync(
        self,
        method: str,
        request: Any,
        timeout: float | None = None,
        unsent: Callable[[], None] | None = None,
    ) -> Any:
        """A unary call, over the local link when there is one, else gRPC; raises grpc.RpcError.

        A wait cut short (an interrupt, the timeout) leaves the reply to `discard_reply`;
        `unsent` runs if the call certainly never reached the sidecar."""
        link = self.link
        if link is not None and method in LINK_METHODS:
            return link.call(method, request, LINK_METHODS[method][1], timeout, self.discard_reply, unsent)
        try:
            stub = getattr(self.stub, method)
        except BaseException:
            if unsent is not None:
                unsent()
            raise
        rpc = stub.future(request, metadata=self.metadata)
        try:
            return rpc.result(timeout)
        except grpc.FutureTimeoutError:
            rpc.add_done_callback(self._discard_rpc)
            raise LinkError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded") from None
        except grpc.RpcError:
            raise
        except BaseException:
            rpc.add_done_callback(self._discard_rpc)
            raise

    def _discard_rpc(self, rpc: Any) -> None:
        try:
            reply = rpc.result()
        except Exception:  # noqa: BLE001 - a failed call carries nothing
            return
        self.discard_reply(reply)

    def discard_reply(self, reply: Any) -> None:
        """Frees what the reply of an abandoned call carries: its blocks, a new remote object."""
        if isinstance(reply, pb.CallReply):
            blocks: Any = reply.result.blocks
            if reply.object_id:
                self.delete_object_soon(reply.object_id, self.generation)
        elif isinstance(reply, pb.AllocateReply):
            blocks = reply.blocks
        else:
            return
        for desc in blocks:
            self._reclaimer.push(("block", desc.id, desc.offset))

    def release_soon(self, block_ids: Any) -> None:
        """Gives back blocks leased to the session that no call and no view holds."""
        for block_id in block_ids:
            self._reclaimer.push(("block", block_id, -1))

    def next_call_id(self) -> int:
        return next(self._call_ids)

    def cancel_soon(self, call_id: int) -> None:
        """Asks the sidecar, in the background, to cancel a call this controller gave up on."""
        self._reclaimer.push(("cancel", call_id, 0))

    def _connect_error(self, e: grpc.RpcError) -> ColocarError:
        code, details = e.code(), e.details()
        if code == grpc.StatusCode.UNAUTHENTICATED:
            return AuthError(
                f"sidecar {self.name} at {self.address} refused the token: pass the token the "
                "sidecar was started with (connect(token=...), COLOCAR_TOKEN or COLOCAR_TOKEN_FILE)"
            )
        if code == grpc.StatusCode.FAILED_PRECONDITION:
            return VersionSkewError(f"sidecar {self.name} at {self.address}: {details}")
        return HostLostError(f"cannot reach sidecar {self.name} at {self.address}: {details}")

    def heartbeat(self) -> None:
        """Renews the session; reconnects after a sidecar restart; marks the host lost when silent."""
        if self._closed:
            return
        try:
            reply = self.sync(
                "Keepalive", pb.SessionRef(session_id=self.session_id), max(2.0, 3 * self.heartbeat_seconds)
            )
        except grpc.RpcError as e:
            # Silence (stopped, hung, cut off) also ends calls waiting on the local link; a
            # refusal (a draining sidecar) only stops new calls. A dead sidecar closes the link.
            self.unresponsive = e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            self.mark_lost(f"no answer to keepalive ({e.code().name}: {e.details()})")
            return
        self.alive_at = self._renewed_at = time.monotonic()
        if not reply.known or self.lost is not None:
            try:
                self.info = self._connect(timeout=max(2.0, 3 * self.heartbeat_seconds))
            except ColocarError as e:
                self.mark_lost(str(e))

    def mark_lost(self, reason: str) -> None:
        if self.lost is None and not self._closed:
            self.lost = HostLostError(f"sidecar {self.name} at {self.address} is lost: {reason}")

    def check_alive(self) -> None:
        if self._closed:
            raise ColocarError(f"connection to sidecar {self.name} is closed")
        if self.lost is not None:
            raise HostLostError(str(self.lost))

    def translate(self, e: grpc.RpcError, what: str) -> Exception:
        """A gRPC failure as the error a user should see."""
        code, details = e.code(), e.details()
        if code in LOST_CODES:
            self.mark_lost(f"{what}: {details}")
            return HostLostError(f"sidecar {self.name} at {self.address} is lost ({what}: {details})")
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return CallTimeoutError(f"{what} on {self.name} timed out (it may still run there)")
        if code == grpc.StatusCode.UNAUTHENTICATED:
            return AuthError(f"{what} on {self.name}: {details}")
        if code == grpc.StatusCode.FAILED_PRECONDITION and details.startswith("unknown session"):
            self.mark_lost(details)
            return HostLostError(
                f"{what} on {self.name}: the sidecar lost this session (restart or expired "
                "lease); remote objects and arrays on it are gone"
            )
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return ArenaFullError(f"{what} on {self.name}: {details}")
        return ColocarError(f"{what} on {self.name} failed: {code.name}: {details}")

    # --- calls -----------------------------------------------------------------------------
    def unary(self, method: str, request: Any, timeout: float | None = None) -> Any:
        self.check_alive()
        try:
            return self.sync(method, request, timeout)
        except grpc.RpcError as e:
            raise self.translate(e, method) from None

    def submit(self, send: Callable[[], Any], unsent: Callable[[], None] | None = None) -> LaneFuture:
        """Runs `send()` (which starts an RPC and returns a future of its reply) after this
        thread's earlier calls to this host have completed or were abandoned; the returned
        future resolves to the reply. `unsent` runs if the call is cancelled while queued."""
        future = LaneFuture(send, unsent)
        key = threading.get_ident()
        with self._lanes_lock:
            lane = self._lanes.get(key)
            if lane is None:
                lane = self._lanes[key] = _Lane()
            future.next = functools.partial(self._pump, key, lane)
            lane.pending.append(future)
            if lane.busy:
                return future
            lane.busy = True
        self._pump(key, lane)
        return future

    def lane_idle(self) -> bool:
        """True when this thread has no call in flight to this host (sync calls may go direct)."""
        lane = self._lanes.get(threading.get_ident())
        return lane is None or not lane.busy

    def _pump(self, key: int, lane: _Lane) -> None:
        """Sends the lane's next call; the lane moves on when it completes or is abandoned."""
        while True:
            with self._lanes_lock:
                if not lane.pending:
                    lane.busy = False
                    if self._lanes.get(key) is lane:
                        del self._lanes[key]
                    return
                future = lane.pending.popleft()
            if future.set_running_or_notify_cancel():
                break
            if future.unsent is not None:
                future.unsent()
        try:
            rpc = future.send()
        except BaseException as e:
            settle(future.set_exception, e)
            future.move_lane_on()
            if not isinstance(e, Exception):
                raise  # an interrupt of the thread that sends: it is that thread's to handle
            return

        def done(rpc_future: Any) -> None:
            try:
                reply = rpc_future.result()
            except BaseException as e:
                settle(future.set_exception, e)
            else:
                if not settle(future.set_result, reply):
                    self.discard_reply(reply)
            future.move_lane_on()

        rpc.add_done_callback(done)

    # --- arrays (see arena_client.py) -----------------------------------------------------
    @property
    def arena(self) -> Arena | None:
        return self.arenas.arena

    @property
    def shm(self) -> bool:
        return self.arenas.mapped

    @property
    def alloc_timeout(self) -> float:
        """How long an allocation waits for room by default (seconds); settable."""
        return self.arenas.alloc_timeout

    @alloc_timeout.setter
    def alloc_timeout(self, seconds: float) -> None:
        self.arenas.alloc_timeout = seconds

    def empty(
        self, specs: list[tuple[tuple[int, ...], np.dtype]], pool: str = "", timeout: float | None = None
    ) -> list[np.ndarray]:
        return self.arenas.empty(specs, pool, timeout)

    def allocate(self, sizes: list[int], pool: str = "", timeout: float | None = None) -> list[pb.BlockDesc]:
        return self.arenas.allocate(sizes, pool, timeout)

    def encode(self, value: Any, what: str) -> tuple[pb.Payload, list[int], list[np.ndarray]]:
        return self.arenas.encode(value, what)

    def decode(self, payload: pb.Payload) -> Any:
        return self.arenas.decode(payload)

    def upload(self, array: np.ndarray) -> pb.BlockDesc:
        return self.arenas.upload(array)

    def download(self, desc: pb.BlockDesc, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        return self.arenas.download(desc, shape, dtype)

    def delete_object_soon(self, object_id: int, generation: int) -> None:
        """Deletes a remote object in the background (called from handle finalizers)."""
        self._reclaimer.push(("object", object_id, generation))

    def _release(self, items: list[tuple[str, int, int]]) -> None:
        """Background: tells the sidecar which blocks and objects we no longer hold."""
        blocks = [ident for kind, ident, _ in items if kind == "block"]
        cancels = [ident for kind, ident, _ in items if kind == "cancel"]
        if self._closed or self.lost is not None:
            return
        try:
            if cancels:
                self.sync("Cancel", pb.CancelRequest(session_id=self.session_id, call_ids=cancels), 30)
            if blocks:
                self.sync("Release", pb.ReleaseRequest(session_id=self.session_id, block_ids=blocks), 30)
            for kind, ident, generation in items:
                if kind == "object" and generation == self.generation:
                    self.sync("DeleteObject", pb.ObjectRef(session_id=self.session_id, object_id=ident), 30)
        except grpc.RpcError:
            pass  # the session's lease frees them if the sidecar cannot be told

    # --- logs and shutdown -----------------------------------------------------------------
    def _forward_logs(self) -> None:
        """Prints the session's log lines, prefixed with the host, for as long as we are open.

        Over the local link the lines are long-polled (`PollLogs`: the thread sleeps in one
        socket read until lines come); without a link they come from a gRPC stream."""
        prefix = f"[{self.name}] "
        poll = True
        while not self._closed:
            link = self.link
            try:
                if poll and link is not None:
                    request = pb.LogPoll(session_id=self.session_id, wait_seconds=LOG_POLL_SECONDS)
                    reply = link.call("PollLogs", request, pb.LogLines, LOG_POLL_SECONDS + 30)
                    for text in reply.lines:
                        _print_line(prefix + text)
                    continue
                for line in self.stub.Logs(pb.SessionRef(session_id=self.session_id), metadata=self.metadata):
                    _print_line(prefix + line.text)
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                    poll = False  # an older sidecar: read the stream
                    continue
            except ValueError:  # the channel was closed under us
                return
            if self._closed:
                return
            threading.Event().wait(self.heartbeat_seconds)

    def stats(self) -> pb.StatsReply:
        return self.unary("Stats", pb.Empty(), timeout=10)

    def close(self) -> None:
        if self._closed:
            return
        self._reclaimer.flush(timeout=5)
        self._closed = True
        self._stop.set()
        if self.lost is None:
            try:
                self.stub.Disconnect(
                    pb.SessionRef(session_id=self.session_id), metadata=self.metadata, timeout=5
                )
            except grpc.RpcError:
                pass
        self._reclaimer.close()
        if self._link_executor is not None:
            self._link_executor.shutdown(wait=False, cancel_futures=True)
        if self.link is not None:
            self.link.close()
        self.channel.close()
        self._log_thread.join(timeout=5)


def _print_line(text: str) -> None:
    """One forwarded line to stdout; a stdout that is closed or replaced meanwhile (test
    capture, a redirected stream) costs that line, never the forwarding thread."""
    try:
        print(text, file=sys.stdout, flush=True)
    except (ValueError, OSError):
        pass
