"""Exceptions that colocar raises on the controller (they name the host and say what to do)."""

from __future__ import annotations


class ColocarError(RuntimeError):
    """Base class of colocar's own errors."""


class HostLostError(ColocarError):
    """A sidecar died, stopped answering or became unreachable; its calls cannot complete."""


class SessionEndedError(ColocarError):
    """This controller's session on a sidecar ended from elsewhere: another controller took the
    named session over, or `colocar sessions close` closed it. Connect again to go on."""


class ObjectNotFoundError(ColocarError, LookupError):
    """No object of that name lives on the host (`host.object(name)`, `cluster.object(name)`),
    or a handle's object is gone from it (deleted, or a detached one past its ttl)."""


class RemoteError(ColocarError):
    """An exception raised by a shipped function that could not be re-raised as its own type."""

    def __init__(self, type_name: str, message: str, host: str, traceback: str):
        super().__init__(f"{type_name}: {message} (on {host})")
        self.type_name = type_name
        self.remote_message = message
        self.host = host
        self.remote_traceback = traceback


class RemoteTraceback(Exception):
    """Carries the sidecar-side traceback as the `__cause__` of a re-raised remote exception."""

    def __init__(self, text: str):
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return self.text


class VersionSkewError(ColocarError):
    """Controller and sidecar run Python / cloudpickle / JAX versions that cannot exchange code."""


class AuthError(ColocarError):
    """The sidecar refused the token (or none was given)."""


class PoolFullError(ColocarError):
    """A shared pool had no room for the tenant: it would not wait, or waited its timeout."""


class QuotaExceededError(ColocarError):
    """A shared pool refused: the tenant's quota (sessions, concurrent calls, arena bytes) is
    used up; the message names the tenant, the quota and the current use."""


class SerializationError(ColocarError, TypeError):
    """An argument or a result could not be pickled or unpickled; the message names the value."""


class CallTimeoutError(ColocarError, TimeoutError):
    """A call did not finish within its timeout (the function may still be running remotely)."""


class ArrayLayoutError(ColocarError, ValueError):
    """A host's shards of an input do not form one block, or an output does not fit its spec."""


class CheckpointError(ColocarError):
    """A save or restore failed; the message names the step, the key, the host and the cause."""


class ProcessesDisagree(ColocarError):
    """Under multi-controller JAX, the processes hold different values for what must be the same
    (an array call's outputs, a data iterator's state or config); names the process that differs."""


class SnapshotError(ColocarError):
    """A host-memory snapshot cannot be restored (or taken); the message names the step, the
    leaf and the hosts whose loss made it unrecoverable."""


class ProcessLostError(ColocarError):
    """Under multi-controller JAX, another JAX process of the job is gone (its liveness beat in
    jax.distributed's key-value store stood still): a job cannot shrink, so this process's
    trainer must exit and be restarted with the others (the elastic manager does so)."""
