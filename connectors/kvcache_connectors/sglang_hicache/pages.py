"""Where a page's bytes lie in SGLang's host pool: views of its segments, never copies.

The host pool says it itself: `get_page_buffer_meta(host_indices)` returns one (pointer, size)
per segment of each page (what Mooncake's and the other zero-copy backends register and
transfer). This module turns those pointers back into byte views of the pool's own tensor, after
checking each lies whole inside it, so the SDK can store a segment straight from the pool and
copy a loaded block straight into it.

    MHA, page_first: kv_buffer[2, tokens, layers, heads, head_dim]
        page p (tokens p*P .. p*P+P-1) = segment 0: kv_buffer[0, p*P : p*P+P]   (K, all layers)
                                         segment 1: kv_buffer[1, p*P : p*P+P]   (V, all layers)
    MHA, page_first_direct: kv_buffer[2, pages, layers, P, heads, head_dim], same two segments
    MLA, page_first: kv_buffer[tokens, layers, 1, kv_cache_dim]
        page p = segment 0: kv_buffer[p*P : p*P+P]                               (latent rows)
    MLA, page_first_direct: kv_buffer[pages, layers, P, 1, kv_cache_dim], one segment

A page's flat form (get_data_page(index, flat=True), what SGLang's generic get/set path moves)
is its segments back to back, in this order.
"""

from __future__ import annotations

from typing import Any

import torch

# Page-first layouts: a page is a few large contiguous segments. layer_first would make it one
# segment per layer (and K/V), page_head and the NPU split layouts keep bytes outside kv_buffer.
SUPPORTED_LAYOUTS = ("page_first", "page_first_direct")


class PageMap:
    """Resolves host indices of a registered host pool to the byte views of their pages' segments.

    Raises (constructor):
        ValueError: the pool's layout is not page-first, or it has no materialized KV buffer.
    """

    def __init__(self, host_pool: Any) -> None:
        layout = getattr(host_pool, "layout", None)
        if layout not in SUPPORTED_LAYOUTS:
            raise ValueError(
                f"the kvcache HiCache backend needs a page-first host layout {SUPPORTED_LAYOUTS}, "
                f"got {layout!r} (--hicache-mem-layout page_first)"
            )
        buffer = getattr(host_pool, "kv_buffer", None)
        if not isinstance(buffer, torch.Tensor) or not buffer.is_contiguous() or buffer.device.type != "cpu":
            raise ValueError("the host pool has no contiguous CPU kv_buffer (a logical-only or split pool)")
        self._pool = host_pool
        self._bytes = buffer.view(-1).view(torch.uint8)
        self._base = buffer.data_ptr()
        self.page_size = int(host_pool.page_size)
        first = torch.arange(self.page_size, dtype=torch.int64)
        _, sizes = host_pool.get_page_buffer_meta(first)
        self.segment_bytes: tuple[int, ...] = tuple(int(n) for n in sizes)
        self.segments = len(self.segment_bytes)
        self.page_bytes = sum(self.segment_bytes)

    def views(self, host_indices: torch.Tensor, pages: int) -> list[torch.Tensor]:
        """The uint8 views of every segment of `pages` pages starting at host_indices[i * page_size].

        Raises:
            ValueError: host_indices do not hold `pages` whole pages, or the pool reports a segment
                that is not inside its buffer or not of the page's segment size.
        """
        if int(host_indices.numel()) != pages * self.page_size:
            raise ValueError(f"{host_indices.numel()} host indices for {pages} pages of {self.page_size} tokens")
        if pages == 0:
            return []
        ptrs, sizes = self._pool.get_page_buffer_meta(host_indices.cpu())
        if len(ptrs) != pages * self.segments or len(sizes) != len(ptrs):
            raise ValueError(f"the host pool reported {len(ptrs)} segments for {pages} pages of {self.segments}")
        total = self._bytes.numel()
        views = []
        for i, (ptr, size) in enumerate(zip(ptrs, sizes, strict=True)):
            offset = int(ptr) - self._base
            size = int(size)
            if size != self.segment_bytes[i % self.segments] or offset < 0 or offset + size > total:
                raise ValueError(f"segment {i} ({size} bytes at offset {offset}) is not a page segment of the pool")
            views.append(self._bytes[offset : offset + size])
        return views

    def split_flat(self, flat_page: torch.Tensor) -> list[torch.Tensor]:
        """A flat page (get_data_page(..., flat=True) or a dummy page) as uint8 views of its segments.

        Raises:
            ValueError: the tensor is not contiguous or not one page's bytes.
        """
        if not flat_page.is_contiguous():
            raise ValueError("a flat page must be contiguous")
        data = flat_page.view(-1).view(torch.uint8)
        if data.numel() != self.page_bytes:
            raise ValueError(f"a flat page of {data.numel()} bytes, the pool's pages are {self.page_bytes}")
        return list(torch.split(data, list(self.segment_bytes)))
