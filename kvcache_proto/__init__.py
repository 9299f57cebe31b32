"""Generated protobuf and gRPC code for kvcache.v1 (see scripts/gen_proto.py)."""
