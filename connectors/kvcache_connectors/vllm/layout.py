"""vLLM's paged KV tensors <-> kvcache's canonical chunk layout (gather on save, scatter on load).

vLLM 0.33 hands `register_kv_caches` one tensor per attention layer, of logical shape
[blocks * bs/kbs, H, kbs, C] (vllm/v1/kv_cache_layout.py: [L, B, H, N, C] less L; the
physical order only changes strides, which indexing the logical view makes irrelevant).
H = KV heads of this rank, D = head size, bs = vLLM's block size, kbs = the kernel's
block size. Where a token's K and V sit in C (or across N) is the attention backend's
own convention, not visible in the shape: two backends read the same shape differently.
So the layout is looked up by the layer's backend class, and the shape is only checked
against it; a backend not in BACKEND_KINDS is refused when the caches are registered.

    PACKED      C = 2*D; token t's K = [e, :, t, :D], V = [e, :, t, D:]
                (FlashAttention, FlashInfer, Triton, FlexAttention: `kv_cache.transpose(1, 2)
                .split(head_size, dim=-1)`)
    SPLIT_ROWS  C = 2*D, read as [e, H, 2*kbs, D]: rows 0..kbs-1 are the keys, rows
                kbs..2*kbs-1 the values (CPU attention: `kv_cache.view(blocks, H,
                2 * block_size, -1).chunk(2, dim=2)`); token t's K is row t, V row kbs+t
    MLA         H = 1, C = D: one latent vector per token (MLAAttention.bind_kv_cache
                squeezes H away)

When the kernel's block is smaller than vLLM's, vLLM splits each block into bs/kbs
consecutive kernel blocks: token t of block b sits in entry b*bs/kbs + t//kbs at
offset t%kbs.

Per layer, the canonical form of T tokens is [2, H, T, D] (MLA: [T, D]); a chunk
stacks the layers in front ([L, 2, H, T, D], docs/format.md).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class PagedKind(enum.Enum):
    """Where one layer's paged tensor keeps a token's K and V (the value describes it)."""

    PACKED = "[blocks, kv_heads, block_size, 2 * head_size] with K = [..., :head_size], V = [..., head_size:]"
    SPLIT_ROWS = (
        "[blocks, kv_heads, block_size, 2 * head_size] viewed as [blocks, kv_heads, 2 * block_size, head_size]"
        " with K = rows [:block_size], V = rows [block_size:]"
    )
    MLA = "[blocks, 1, block_size, head_size]"


# vLLM 0.33's attention backends whose per-layer split was read from their source, by the
# backend class's qualified name (as vllm/v1/attention/backends/registry.py names it).
# Backends with unequal K/V head sizes or packed/quantized pages are absent on purpose.
_BACKENDS = "vllm.v1.attention.backends."
BACKEND_KINDS: dict[str, PagedKind] = {
    # FlashAttentionImpl.forward: kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
    _BACKENDS + "flash_attn.FlashAttentionBackend": PagedKind.PACKED,
    # FlashInferImpl.forward (not NVFP4, which the connector refuses): kv_cache_permute.split(hs, dim=-1)
    _BACKENDS + "flashinfer.FlashInferBackend": PagedKind.PACKED,
    # TritonAttentionImpl: kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
    _BACKENDS + "triton_attn.TritonAttentionBackend": PagedKind.PACKED,
    # FlexAttentionImpl.forward: kv_cache.transpose(1, 2).split(hs, dim=-1)
    _BACKENDS + "flex_attention.FlexAttentionBackend": PagedKind.PACKED,
    # CPUAttentionBackendImpl.do_kv_cache_update / forward:
    # kv_cache.view((num_blocks, num_kv_heads, block_size * 2, -1)).chunk(2, dim=2)
    _BACKENDS + "cpu_attn.CPUAttentionBackend": PagedKind.SPLIT_ROWS,
    # MLAAttention.bind_kv_cache: kv_cache.squeeze(1), one latent row per slot.
    _BACKENDS + "mla.flashmla.FlashMLABackend": PagedKind.MLA,
    _BACKENDS + "mla.triton_mla.TritonMLABackend": PagedKind.MLA,
    _BACKENDS + "mla.cutlass_mla.CutlassMLABackend": PagedKind.MLA,
    _BACKENDS + "mla.flashinfer_mla.FlashInferMLABackend": PagedKind.MLA,
    _BACKENDS + "mla.flashattn_mla.FlashAttnMLABackend": PagedKind.MLA,
    # CPUMLAImpl.do_kv_cache_update: kv_cache.view(-1, kv_lora_rank + pe_dim)[slots]
    _BACKENDS + "mla.cpu_mla.CPUMLABackend": PagedKind.MLA,
}


def backend_path(backend: type) -> str:
    """An attention backend class's qualified name, e.g. vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend."""
    return f"{backend.__module__}.{backend.__qualname__}"


@dataclass(frozen=True, slots=True)
class PagedLayout:
    """How one layer's paged tensor holds its tokens.

    Attributes:
        kind: Where a token's K and V sit.
        block_size: vLLM's block size (tokens per block id).
        kernel_block_size: Tokens per entry of the tensor's block dimension.
        head_size: D.
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

    def _rows(self, cache: torch.Tensor, offset: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """SPLIT_ROWS: (cache as [E, H, kbs, 2, D], K's and V's (offset, half) in it).

        Row r of the backend's [E, H, 2*kbs, D] view is element (r // 2, r % 2) of
        [E, H, kbs, 2, D]: the same row-major flattening of the last two dimensions
        that its `view` relies on, but valid for any strides.
        """
        halves = cache.unflatten(-1, (2, self.head_size))
        k_row, v_row = offset, offset + self.kernel_block_size
        return halves, torch.stack([k_row // 2, v_row // 2]), torch.stack([k_row % 2, v_row % 2])

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
            case PagedKind.SPLIT_ROWS:
                halves, rows, half = self._rows(cache, offset)
                # [2, T] indices -> [2, T, H, D]
                return halves[entry.expand(2, -1), :, rows, half].permute(0, 2, 1, 3)
            case PagedKind.MLA:
                return cache[entry, 0, offset]

    def scatter(self, cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor, values: torch.Tensor) -> None:
        """Writes canonical per-layer values ([2, H, T, D], MLA: [T, D]) into the tokens' slots.

        `values` must already have cache's dtype and device.
        """
        entry, offset = self._entries(blocks, offsets)
        match self.kind:
            case PagedKind.PACKED:
                cache[entry, :, offset, :] = values.permute(2, 1, 0, 3).flatten(-2)
            case PagedKind.SPLIT_ROWS:
                halves, rows, half = self._rows(cache, offset)
                halves[entry.expand(2, -1), :, rows, half] = values.permute(0, 2, 1, 3)
            case PagedKind.MLA:
                cache[entry, 0, offset] = values


def paged_layout(
    layer_name: str,
    backend: type | None,
    shape: tuple[int, ...],
    *,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    mla: bool,
) -> PagedLayout:
    """The layout of a layer's paged tensor, from its attention backend; the shape must fit it.

    Args:
        layer_name: The layer, for messages.
        backend: The layer's attention backend class (vLLM's `layer.get_attn_backend()`), None if unknown.
        shape: The tensor's logical shape.
        num_kv_heads, head_size, block_size, mla: From the KV-cache spec.

    Raises:
        ValueError: no backend is known for the layer, the backend is not one whose layout this
            connector knows, or the tensor's shape is not that layout's for the spec.
    """
    if backend is None:
        raise ValueError(
            f"layer {layer_name!r}: vLLM exposes no attention backend for it, so KVCacheConnector cannot "
            "know where its K and V sit (a layout is never guessed from a shape)"
        )
    path = backend_path(backend)
    kind = BACKEND_KINDS.get(path)
    name = getattr(backend, "get_name", lambda: path)()
    if kind is None:
        supported = ", ".join(sorted(p.rsplit(".", 1)[1] for p in BACKEND_KINDS))
        raise ValueError(
            f"layer {layer_name!r}: attention backend {name} ({path}) is not supported by KVCacheConnector: "
            f"its paged KV layout is unknown to it; supported backends: {supported}"
        )
    if (kind is PagedKind.MLA) != mla:
        raise ValueError(
            f"layer {layer_name!r}: attention backend {name} is {'' if kind is PagedKind.MLA else 'not '}an MLA "
            f"backend, but the KV-cache spec is {'' if mla else 'not '}MLA"
        )
    heads, content = (1, head_size) if mla else (num_kv_heads, 2 * head_size)
    if len(shape) == 4 and shape[1] == heads and shape[3] == content:
        kbs = shape[2]
        # A kernel block that divides vLLM's block, with a whole number of vLLM blocks.
        if kbs >= 1 and block_size % kbs == 0 and shape[0] % (block_size // kbs) == 0:
            return PagedLayout(kind, block_size, kbs, head_size)
    raise ValueError(
        f"layer {layer_name!r}: paged KV tensor of shape {shape} is not attention backend {name}'s layout "
        f"{kind.value} for {heads} KV heads of size {head_size}, block size {block_size}"
    )


def token_slots(block_ids: tuple[int, ...], start: int, end: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block ids and in-block offsets (int64, CPU) of a request's tokens start..end-1."""
    positions = torch.arange(start, end, dtype=torch.int64)
    table = torch.tensor(block_ids, dtype=torch.int64)
    return table[positions // block_size], positions % block_size
