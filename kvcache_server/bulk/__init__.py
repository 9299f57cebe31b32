"""The bulk path for remote clients (docs/bulk.md): block bytes on a plain TCP or TLS stream.

gRPC stays the control plane (Lookup, Delete, Stats, Info, which advertises this listener); Puts
and Gets of block bytes may travel here instead, in length-prefixed frames (kvcache_core.bulkwire)
received with recv_into into buffers reserved from a BlockSink and sent with sendmsg. Modules:
sink (where received blocks land, and how they are committed), session (one connection's frames),
listener (accepting, TLS, connection limits, shutdown).
"""

from kvcache_server.bulk.listener import BulkCounters, BulkListener
from kvcache_server.bulk.sink import ArenaSink, BlockSink, BufferSink, Slot

__all__ = ["ArenaSink", "BlockSink", "BufferSink", "BulkCounters", "BulkListener", "Slot"]
