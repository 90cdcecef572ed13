"""Generated gRPC stubs for the kvfleet.v1 protocol (proto/kvfleet/v1/*.proto).

Every *_pb2.py, *_pb2.pyi and *_pb2_grpc.py here is written by `scripts/gen_proto.py`
(`make proto`) and checked for staleness by tests/shared/test_proto_stubs.py: edit the
.proto files, then regenerate; never edit the stubs by hand.
"""
