"""Ctrl-C inside gRPC's own call set-up never leaves the channel unable to close.

gRPC Python registers a new call on the channel and only then counts it for the thread that
completes calls; a KeyboardInterrupt between the two (a few bytecodes) strands the call, and
closing the channel (`close()`, or its finalizer during a later garbage collection) then waits
forever. The test lands a real SIGINT in exactly that window, by a line tracer on gRPC's code.
"""

from __future__ import annotations

import linecache
import signal
import sys
import threading
from typing import Any

import numpy as np
import pytest
from helpers import DEADLINE
from interrupts_helpers import ident, settled, shifted, shifted_items, used

WINDOW = "state.managed_calls == 0"  # the line right after the call is registered


def _sigint_in_the_window() -> dict[str, int]:
    """Installs a tracer (this thread) that raises SIGINT once, on the first line of gRPC's
    call registration matching WINDOW; returns the counter of signals sent."""
    sent = {"signals": 0}

    def local(frame: Any, event: str, _arg: Any) -> Any:
        if event == "line" and not sent["signals"]:
            if WINDOW in linecache.getline(frame.f_code.co_filename, frame.f_lineno):
                sent["signals"] += 1
                signal.raise_signal(signal.SIGINT)
        return local

    def tracer(frame: Any, event: str, _arg: Any) -> Any:
        code = frame.f_code
        if event == "call" and code.co_name == "create" and code.co_filename.endswith("grpc/_channel.py"):
            return local
        return None

    sys.settrace(tracer)
    return sent


def _start(kind: str, host: Any) -> Any:
    """One call of `kind`, each set up over gRPC (the cluster has no shared memory)."""
    x = np.arange(64 * 1024, dtype=np.int32)
    if kind == "call":
        return ident.on(host)("interrupted")
    if kind == "submit":
        return ident.on(host).submit("interrupted").result()
    if kind == "generator":
        return list(shifted_items.on(host)(x, 1, 3, 0.0))
    return shifted.on(host)(x, 1, 0.0)  # "download": the result's bytes come in a stream


@pytest.mark.parametrize("kind", ["call", "submit", "generator", "download"])
def test_ctrl_c_inside_grpcs_call_set_up_still_lets_the_cluster_close(kind, make_cluster):
    c = make_cluster(hosts=1, shm=False)
    host = c.hosts[0]
    assert ident.on(host)("warm") == "warm"
    baseline = used(c)
    sent = _sigint_in_the_window()
    try:
        with pytest.raises(KeyboardInterrupt):
            _start(kind, host)
    finally:
        sys.settrace(None)
    assert sent["signals"] == 1, "the tracer never reached gRPC's call registration"
    assert ident.on(host)(("own", 1)) == ("own", 1)
    assert int(shifted.on(host)(np.arange(8, dtype=np.int32), 5, 0.0)[-1]) == 12
    settled(c, baseline)  # the interrupted call's reply and blocks are gone too

    closing = threading.Thread(target=c.close, name="test-close", daemon=True)
    closing.start()
    closing.join(DEADLINE)
    assert not closing.is_alive(), "cluster.close() hangs: a call stranded in gRPC's channel"


_HELD_AT_EXIT = """
from colocar.controller_bridge.sigint import sigint_held

class Late:
    def __del__(self):  # runs as the interpreter tears its modules down
        with sigint_held():
            pass
        print("held at exit", flush=True)

late = Late()
"""


def test_a_hold_at_exit_does_nothing_and_says_nothing():
    """A finalizer's call at exit (a gRPC call made as a dropped object goes) holds nothing
    back: Python's SIGINT handler and the signal module are gone then, and swapping them
    raised a TypeError, printed as the script ended."""
    import subprocess

    done = subprocess.run([sys.executable, "-c", _HELD_AT_EXIT], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert done.stdout == "held at exit\n"
