"""vLLM's paged KV tensors <-> kvcache's canonical chunk layout (gather on save, scatter on load).

vLLM hands `register_kv_caches` one tensor per attention layer. Its *logical* shape
depends on the vLLM version and the attention type; its strides depend on the
physical layout (NHD/HND, layer- or block-major), which indexing the logical view
makes irrelevant. The shapes this module knows (H = KV heads of this rank,
D = head size, bs = vLLM's block size, kbs = the kernel's block size):

    PACKED     [blocks * bs/kbs, H, kbs, 2*D]   vLLM 0.33 FlashAttention/FlashInfer;
                                                K = [..., :D], V = [..., D:]
    KV_FIRST   [2, blocks, bs, H, D]            older vLLM (until mid-2026); ROCm
    KV_SECOND  [blocks, 2, bs, H, D]            older vLLM (briefly, mid-2026)
    MLA        [blocks * bs/kbs, 1, kbs, D]     vLLM 0.33 MLA: one latent vector per token
    MLA_3D     [blocks, bs, D]                  older vLLM MLA

When the kernel's block is smaller than vLLM's, vLLM splits each block into bs/kbs
consecutive kernel blocks: token t of block b sits in entry b*bs/kbs + t//kbs at
offset t%kbs. Any other shape is refused when the caches are registered.

Per layer, the canonical form of T tokens is [2, H, T, D] (MLA: [T, D]); a chunk
stacks the layers in front ([L, 2, H, T, D], docs/format.md).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class PagedKind(enum.Enum):
    """A logical shape of vLLM's per-layer paged KV tensor (the value describes it)."""

    PACKED = "[blocks, kv_heads, block_size, 2 * head_size]"
    KV_FIRST = "[2, blocks, block_size, kv_heads, head_size]"
    KV_SECOND = "[blocks, 2, block_size, kv_heads, head_size]"
    MLA = "[blocks, 1, block_size, head_size]"
    MLA_3D = "[blocks, block_size, head_size]"


@dataclass(frozen=True, slots=True)
class PagedLayout:
    """How one layer's paged tensor holds its tokens.

    Attributes:
        kind: The logical shape.
        block_size: vLLM's block size (tokens per block id).
        kernel_block_size: Tokens per entry of the tensor's block dimension.
        head_size: D; PACKED splits its last dimension at it.
    """

    kind: PagedKind
    block_size: int
    kernel_block_size: int
    head_size: int

    def _entries(self, blocks: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(entry of the block dimension, offset within it) of each token."""
        if self.kernel_block_size == self.block_size:
            return blocks, offsets
        ratio = self.block_size // self.kernel_block_size
        return blocks * ratio + offsets // self.kernel_block_size, offsets % self.kernel_block_size

    def gather(self, cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Copies the tokens at (block id, offset) out of `cache` in canonical per-layer form.

        Args:
            cache: The layer's tensor, as registered.
            blocks: int64 block ids of the T tokens, on cache's device.
            offsets: int64 offsets within those blocks.

        Returns:
            A new tensor [2, H, T, D] (MLA: [T, D]) on cache's device.
        """
        entry, offset = self._entries(blocks, offsets)
        match self.kind:
            case PagedKind.PACKED:
                return cache[entry, :, offset, :].unflatten(-1, (2, self.head_size)).permute(2, 1, 0, 3)
            case PagedKind.KV_FIRST:
                return cache[:, entry, offset].permute(0, 2, 1, 3)
            case PagedKind.KV_SECOND:
                return cache[entry, :, offset].permute(1, 2, 0, 3)
            case PagedKind.MLA:
                return cache[entry, 0, offset]
            case PagedKind.MLA_3D:
                return cache[entry, offset]

    def scatter(self, cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor, values: torch.Tensor) -> None:
        """Writes canonical per-layer values ([2, H, T, D], MLA: [T, D]) into the tokens' slots.

        `values` must already have cache's dtype and device.
        """
        entry, offset = self._entries(blocks, offsets)
        match self.kind:
            case PagedKind.PACKED:
                cache[entry, :, offset, :] = values.permute(2, 1, 0, 3).flatten(-2)
            case PagedKind.KV_FIRST:
                cache[:, entry, offset] = values.permute(0, 2, 1, 3)
            case PagedKind.KV_SECOND:
                cache[entry, :, offset] = values.permute(2, 0, 1, 3)
            case PagedKind.MLA:
                cache[entry, 0, offset] = values
            case PagedKind.MLA_3D:
                cache[entry, offset] = values


def detect_layout(
    layer_name: str,
    shape: tuple[int, ...],
    *,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    mla: bool,
) -> PagedLayout:
    """Recognises a layer's paged tensor from its logical shape and the KV-cache spec.

    Raises:
        ValueError: the shape is none of the known layouts, or fits two of them.
    """
    candidates: list[PagedLayout] = []

    def kernel_split(entries: int, kernel_block: int) -> int | None:
        # A kernel block that divides vLLM's block, with a whole number of vLLM blocks.
        if kernel_block < 1 or block_size % kernel_block or entries % (block_size // kernel_block):
            return None
        return kernel_block

    if mla:
        if len(shape) == 4 and shape[1] == 1 and shape[3] == head_size:
            kbs = kernel_split(shape[0], shape[2])
            if kbs is not None:
                candidates.append(PagedLayout(PagedKind.MLA, block_size, kbs, head_size))
        if len(shape) == 3 and shape[1:] == (block_size, head_size):
            candidates.append(PagedLayout(PagedKind.MLA_3D, block_size, block_size, head_size))
    else:
        if len(shape) == 4 and shape[1] == num_kv_heads and shape[3] == 2 * head_size:
            kbs = kernel_split(shape[0], shape[2])
            if kbs is not None:
                candidates.append(PagedLayout(PagedKind.PACKED, block_size, kbs, head_size))
        if len(shape) == 5 and shape[2:] == (block_size, num_kv_heads, head_size):
            if shape[0] == 2:
                candidates.append(PagedLayout(PagedKind.KV_FIRST, block_size, block_size, head_size))
            if shape[1] == 2:
                candidates.append(PagedLayout(PagedKind.KV_SECOND, block_size, block_size, head_size))
    if len(candidates) == 1:
        return candidates[0]
    what = (
        f"MLA latents of size {head_size}" if mla else f"{num_kv_heads} KV heads of size {head_size}"
    ) + f", block size {block_size}"
    if candidates:
        raise ValueError(
            f"layer {layer_name!r}: paged KV tensor of shape {shape} is ambiguous ({what}): it fits "
            f"{' and '.join(c.kind.value for c in candidates)}"
        )
    known = [PagedKind.MLA, PagedKind.MLA_3D] if mla else [PagedKind.PACKED, PagedKind.KV_FIRST, PagedKind.KV_SECOND]
    raise ValueError(
        f"layer {layer_name!r}: paged KV tensor of shape {shape} matches no layout KVCacheConnector knows "
        f"for {what}; known layouts: {', '.join(k.value for k in known)}"
    )


def token_slots(block_ids: tuple[int, ...], start: int, end: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block ids and in-block offsets (int64, CPU) of a request's tokens start..end-1."""
    positions = torch.arange(start, end, dtype=torch.int64)
    table = torch.tensor(block_ids, dtype=torch.int64)
    return table[positions // block_size], positions % block_size
