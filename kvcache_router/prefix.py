"""How much of a prompt kvcache already holds: the prompt's chunk keys, one Lookup, a routing decision.

The keys are exactly those the workers store under (kvcache_core.keys: chained over every token
before them, in the workers' namespace), so a Lookup answers "the first N chunks of this prompt are
stored". The router skips the prefill worker when N covers every chunk but the last: the decode
worker then computes at most one chunk (at most chunk_tokens tokens) itself. A prompt of one
chunk or less is therefore never prefilled elsewhere: when none of it is stored, that is for its
length (`too_short`, route "short"), not for the cache (route "skip").

A failed or late Lookup counts as nothing stored: the request is prefilled as if the cache were cold,
never answered from KV that may not be there.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from kvcache_client import AsyncKVCacheClient, KVCacheError
from kvcache_core.keys import Namespace, chunk_keys, head_block_key

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Coverage:
    """The stored prefix of one prompt.

    Attributes:
        chunks: Chunks of the prompt (its final partial chunk included).
        stored_chunks: The first this many are stored.
        cached_tokens: Tokens they cover.
    """

    chunks: int
    stored_chunks: int
    cached_tokens: int

    @property
    def skip_prefill(self) -> bool:
        """Whether the stored prefix leaves at most the last chunk to compute."""
        return self.stored_chunks >= self.chunks - 1

    @property
    def too_short(self) -> bool:
        """Whether the prompt goes straight to decode for its length alone: one chunk or less, none stored."""
        return self.chunks <= 1 and self.stored_chunks == 0


class PrefixOracle:
    """Asks kvcache for the stored prefix of prompts in one namespace.

    Args:
        client: An async client of the kvcache server the workers use.
        lookup_timeout_s: The Lookup's deadline; a late answer is a miss.
    """

    def __init__(self, client: AsyncKVCacheClient, *, lookup_timeout_s: float) -> None:
        self.client = client
        self.namespace: Namespace | None = None
        # (heads per block, all heads) in a head-sharded namespace whose chunks are stored in
        # several blocks: the first block of each chunk is looked up. None: keys are whole chunks.
        self.head_block: tuple[int, int] | None = None
        self._timeout_s = lookup_timeout_s

    async def coverage(self, tokens: Sequence[int], *, cache_salt: str = "") -> Coverage | None:
        """The stored prefix of `tokens`, under the request's `cache_salt`; None without a namespace or answer.

        Raises:
            ValueError: a token id outside [0, 2**32) (the tokenizer's answer is wrong).
        """
        namespace = self._namespace(cache_salt)
        if namespace is None or not tokens:
            return None
        keys = chunk_keys(tokens, namespace)
        stored_keys = keys
        if self.head_block is not None:
            per_block, total = self.head_block
            stored_keys = [head_block_key(k, 0, per_block, total) for k in keys]
        try:
            found = await self.client.lookup(namespace, stored_keys, timeout_s=self._timeout_s)
        except KVCacheError as exc:
            log.warning("kvcache lookup failed, routing as uncached: %s", exc)
            return None
        stored = found.prefix_length
        return Coverage(len(keys), stored, min(stored * namespace.chunk_tokens, len(tokens)))

    def prefix_blocks(self, tokens: Sequence[int], *, cache_salt: str = "") -> tuple[Namespace, list[bytes]] | None:
        """The namespace and the keys of every stored block of the prompt's chunks, chunk by chunk (each
        head block of a head-sharded chunk); None without a namespace or tokens.

        Raises:
            ValueError: a token id outside [0, 2**32).
        """
        namespace = self._namespace(cache_salt)
        if namespace is None or not tokens:
            return None
        keys = chunk_keys(tokens, namespace)
        if self.head_block is None:
            return namespace, keys
        per_block, total = self.head_block
        return namespace, [
            head_block_key(k, first, per_block, total) for k in keys for first in range(0, total, per_block)
        ]

    def _namespace(self, cache_salt: str) -> Namespace | None:
        namespace = self.namespace
        if namespace is not None and cache_salt != namespace.cache_salt:
            namespace = dataclasses.replace(namespace, cache_salt=cache_salt)
        return namespace
