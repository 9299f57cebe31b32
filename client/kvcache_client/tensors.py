"""torch tensors <-> blocks, with one copy on the way out and none on the way in.

Imported lazily by the clients: importing kvcache_client does not import torch.
"""

from __future__ import annotations

import warnings

import torch

from kvcache_core.format import BlockParts, DType, Layout, decode_block, encode_block_parts


def torch_dtype(dtype: DType) -> torch.dtype:
    """DType -> torch.dtype (raises ValueError if this torch lacks it, e.g. float8 on old builds)."""
    value = getattr(torch, dtype.name.lower(), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"this torch build has no {dtype.name.lower()}")
    return value


def block_dtype(dtype: torch.dtype) -> DType:
    """torch.dtype -> DType."""
    return DType.from_name(str(dtype))


def tensor_block_parts(
    tensor: torch.Tensor, key: bytes, layout: Layout = Layout.CANONICAL, *, checksum: bool = True
) -> BlockParts:
    """A tensor as the parts (header, payload view) of its block under `key`, reading a contiguous
    CPU tensor in place (checksum=False: the header's checksum 0, for the server to seal).

    KVCacheClient.put_many sends parts with one copy of the payload, into the gRPC message.
    The view shares the tensor's memory: do not modify the tensor until the put returns.
    """
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    raw = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""
    return encode_block_parts(
        memoryview(raw), key=key, dtype=block_dtype(t.dtype), shape=tuple(t.shape), layout=layout, checksum=checksum
    )


def tensor_to_block(tensor: torch.Tensor, key: bytes, layout: Layout = Layout.CANONICAL) -> bytes:
    """Encodes a tensor as one block (bytes) under `key`; its payload is copied once."""
    return b"".join(tensor_block_parts(tensor, key, layout))


def block_to_tensor(data: bytes | memoryview, key: bytes | None = None, *, verify: bool = True) -> torch.Tensor:
    """Decodes a block into a CPU tensor that views `data`'s payload without a copy.

    The tensor shares memory with `data` and is read-only by contract, but torch has no read-only
    tensors, so a write is not refused: it changes `data`'s buffer in place (a received message or a
    client's get segment: that client's own memory, never the server's stored block), and with it
    every view of that buffer. Clone it, or copy it into its destination, before writing to it.

    Raises:
        BlockFormatError, ChecksumMismatch: `data` is not a valid block under `key` (verify on).
        TypeError: verify is on and no key was given.
    """
    header, payload = decode_block(data, key, verify=verify)
    dtype = torch_dtype(header.dtype)
    if header.raw_len == 0:
        return torch.empty(header.shape, dtype=dtype)
    with warnings.catch_warnings():
        # torch warns on every call that the buffer is not writable and that writes through the
        # tensor are undefined; the docstrings state the rule instead (read-only by contract, clone to
        # modify) and what a write does (changes this client's buffer, never the server's block).
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(payload, dtype=torch.uint8)
    return flat.view(dtype).reshape(header.shape)
