"""Re-exports kvcache_core.blockwire (the contract now lives in kvcache_core; this import path keeps working)."""

from kvcache_core.blockwire import (  # noqa: F401
    BlockData,
    BlockPart,
    Buffer,
    GetItem,
    GetPart,
    PutData,
    PutMessage,
    ShmRange,
    block_cost,
    data_len,
    decode_get_response,
    decode_put_request,
    encode_get_response,
    encode_put_request,
    split_block,
)
