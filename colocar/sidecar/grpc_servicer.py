"""The sidecar's service on gRPC: the token check, then the handler; a refusal becomes the status.

Every RPC checks the token first (constant time, before any unpickling; `auth.TokenInterceptor`
refused a call without it already, before its message was read). The handlers
(`SidecarService`) know nothing of gRPC except the context the two long streams watch; a
`Refused` they raise ends the call with its status and details (`context.abort`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import grpc

from colocar.protocol import colocar_pb2_grpc as pb_grpc
from colocar.protocol.status import Refused

from .auth import Token, metadata_token
from .service import SidecarService

_GRPC_CODES = {code.value[0]: code for code in grpc.StatusCode}
# handler(request) -> reply; Upload takes the request stream the same way
_UNARY = (
    "Connect",
    "Keepalive",
    "Disconnect",
    "ListSessions",
    "CloseSession",
    "Call",
    "Cancel",
    "DeleteObject",
    "FindObject",
    "Allocate",
    "Release",
    "Upload",
    "PollLogs",
    "Stats",
)
_STREAMED = ("Download",)  # handler(request) -> replies
_STREAMED_WITH_CONTEXT = ("Stream", "Logs")  # handler(request, context) -> replies


class GrpcServicer(pb_grpc.SidecarServicer):
    """`SidecarService` on gRPC (its methods are made below, one per RPC)."""

    UNARY, STREAMED = _UNARY, _STREAMED + _STREAMED_WITH_CONTEXT

    def __init__(self, service: SidecarService, token: Token):
        self.service = service
        self._token = token

    def check(self, context: grpc.ServicerContext) -> None:
        """Aborts the call unless it carries the sidecar's token."""
        if self._token.proven_by(metadata_token(context.invocation_metadata())) is None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong colocar token")


def _abort(context: grpc.ServicerContext, refused: Refused) -> NoReturn:
    context.abort(_GRPC_CODES.get(refused.status, grpc.StatusCode.UNKNOWN), refused.details)
    raise AssertionError("unreachable")


def _unary(name: str) -> Callable[..., Any]:
    def method(self: GrpcServicer, request: Any, context: grpc.ServicerContext) -> Any:
        self.check(context)
        try:
            return getattr(self.service, name)(request)
        except Refused as e:
            _abort(context, e)

    return method


def _streamed(name: str, with_context: bool) -> Callable[..., Any]:
    def method(self: GrpcServicer, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        self.check(context)
        handler = getattr(self.service, name)
        try:
            yield from handler(request, context) if with_context else handler(request)
        except Refused as e:
            _abort(context, e)

    return method


for _name in _UNARY:
    setattr(GrpcServicer, _name, _unary(_name))
for _name in _STREAMED + _STREAMED_WITH_CONTEXT:
    setattr(GrpcServicer, _name, _streamed(_name, _name in _STREAMED_WITH_CONTEXT))
