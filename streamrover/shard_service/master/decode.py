"""Requests the master decodes itself: bytes that are no message of the method's type are ``INVALID_ARGUMENT``.

gRPC's own decoding answers them ``INTERNAL`` ("Exception deserializing request!"), a status clients retry as
transient (a frame cut short when a master dies mid-answer is ``INTERNAL`` too): a client with a bug would retry
garbage until its timeout. :func:`add_servicer` registers the generated handlers with gRPC's decoding switched off
(raw bytes in) and each request parsed here, the parse error answered ``INVALID_ARGUMENT`` naming the call and the
message type. A stream's messages are parsed as the servicer reads them: a bad one ends the stream so.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc

from streamrover.shard_service.v1 import shard_service_pb2_grpc as pb_grpc


def _decoder(deserialize: Callable[[bytes], Any], call: str) -> Callable[[bytes, grpc.ServicerContext], Any]:
    def decode(raw: bytes, context: grpc.ServicerContext) -> Any:
        try:
            return deserialize(raw)
        except Exception as exc:  # protobuf's DecodeError (and whatever a parser of bytes may raise)
            what = getattr(getattr(deserialize, "__self__", None), "__name__", "request")
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"{call}: the request is not a valid {what} message ({exc})")  # fmt: skip

    return decode


def strict(handler: grpc.RpcMethodHandler, call: str) -> grpc.RpcMethodHandler:
    """``handler`` taking raw bytes and parsing them itself (see the module docstring)."""
    if handler.request_deserializer is None:
        return handler
    decode = _decoder(handler.request_deserializer, call)
    out = handler.response_serializer

    def each(raws: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[Any]:
        for raw in raws:
            yield decode(raw, context)

    if handler.unary_unary is not None:
        uu = handler.unary_unary
        return grpc.unary_unary_rpc_method_handler(lambda raw, ctx: uu(decode(raw, ctx), ctx), None, out)
    if handler.unary_stream is not None:
        us = handler.unary_stream
        return grpc.unary_stream_rpc_method_handler(lambda raw, ctx: us(decode(raw, ctx), ctx), None, out)
    if handler.stream_unary is not None:
        su = handler.stream_unary
        return grpc.stream_unary_rpc_method_handler(lambda raws, ctx: su(each(raws, ctx), ctx), None, out)
    ss = handler.stream_stream
    assert ss is not None
    return grpc.stream_stream_rpc_method_handler(lambda raws, ctx: ss(each(raws, ctx), ctx), None, out)


class _Registrar:
    """What the generated ``add_..._to_server`` calls, forwarding strict handlers to the real server."""

    def __init__(self, server: grpc.Server) -> None:
        self.server = server

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        """The generated generic handler decodes with gRPC: replaced by :meth:`add_registered_method_handlers`'s."""

    def add_registered_method_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        mine = {name: strict(h, name) for name, h in handlers.items()}
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, mine),))
        self.server.add_registered_method_handlers(service, mine)


def add_servicer(servicer: pb_grpc.ShardServiceServicer, server: grpc.Server) -> None:
    """``add_ShardServiceServicer_to_server``, with the requests decoded here (INVALID_ARGUMENT when they are not)."""
    pb_grpc.add_ShardServiceServicer_to_server(servicer, _Registrar(server))  # type: ignore[arg-type]


__all__ = ["add_servicer", "strict"]
