"""Status codes of a refused or failed RPC, the same on gRPC and on the local link.

The numbers are the canonical RPC status codes (gRPC's numbering), so the local link's status
byte and gRPC's status mean the same. Sidecar handlers raise `Refused`; the gRPC adapter turns
it into the call's status, the link server into a status frame. On the controller both
transports raise `TransportError`, translated once into the error a user sees.
"""

from __future__ import annotations

import enum

QUOTA_REACHED = "quota reached"  # in a RESOURCE_EXHAUSTED refusal: a tenant's quota, not a full arena
ARENA_QUOTA_REACHED = f"arena {QUOTA_REACHED}"  # the tenant's arena quota (also a full arena, to it)


class Status(enum.IntEnum):
    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16

    @classmethod
    def of(cls, value: int) -> Status:
        """The status of a number from the wire (UNKNOWN for one we do not know)."""
        try:
            return cls(value)
        except ValueError:
            return cls.UNKNOWN


class StatusError(Exception):
    """An RPC that ended without a reply: its status and the details for a human."""

    def __init__(self, status: Status, details: str):
        super().__init__(f"{status.name}: {details}")
        self.status = status
        self.details = details


class Refused(StatusError):
    """A sidecar handler's refusal of a request (raised instead of a reply)."""


class TransportError(StatusError):
    """A unary call that brought no reply, on the controller: the sidecar refused it, or the
    transport failed (UNAVAILABLE: broken or closed; DEADLINE_EXCEEDED: no answer in time)."""
