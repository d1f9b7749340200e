"""The transports' shared vocabulary: status numbers and the gRPC adapter of every RPC."""

from __future__ import annotations

import grpc
from helpers import printed_until, recorded_stdout

import colocar
from colocar.protocol import colocar_pb2 as pb
from colocar.protocol import colocar_pb2_grpc as pb_grpc
from colocar.protocol.link import METHODS as LINK_METHODS
from colocar.protocol.status import Status
from colocar.sidecar.grpc_servicer import GrpcServicer
from colocar.sidecar.service import SidecarService


def test_status_numbers_are_grpcs():
    # the local link's status byte and gRPC's status code must mean the same
    assert {code.name: code.value[0] for code in grpc.StatusCode} == {s.name: s.value for s in Status}
    assert Status.of(200) == Status.UNKNOWN and Status.of(5) == Status.NOT_FOUND


def test_every_rpc_has_its_grpc_adapter_and_handler():
    methods = set(pb.DESCRIPTOR.services_by_name["Sidecar"].methods_by_name)
    assert set(GrpcServicer.UNARY) | set(GrpcServicer.STREAMED) == methods
    for name in methods:  # not the generated base's UNIMPLEMENTED stub
        assert getattr(GrpcServicer, name) is not getattr(pb_grpc.SidecarServicer, name), name
        assert callable(getattr(SidecarService, name, None)), name
    assert set(LINK_METHODS) <= set(GrpcServicer.UNARY), "the link serves unary methods only"


def test_code_is_resent_over_grpc_too(grpc_cluster):
    # the same resend as over the local link (test_objects), on gRPC's sync and async paths
    @colocar.colocated
    def fresh_over_grpc():
        return "ran"

    host = grpc_cluster.hosts[0]
    assert host.connection.transport.link is None
    code_hash, _ = fresh_over_grpc._code.pickled()
    host.connection.session.known_code.add(code_hash)  # as if sent before a sidecar restart
    assert fresh_over_grpc.on(host)() == "ran"
    host.connection.session.known_code.add(code_hash)
    assert fresh_over_grpc.on(host).submit().result() == "ran"


def test_logs_reach_the_controller_over_grpc(grpc_cluster):
    @colocar.colocated
    def talk_over_grpc():
        print("hello over grpc")
        return 1

    with recorded_stdout() as stdout:
        talk_over_grpc.on(grpc_cluster.hosts[1])()
        seen = printed_until(stdout, "[host1] hello over grpc")
    assert "[host1] hello over grpc\n" in seen
