"""Where K and V live between steps: the contiguous cache of chapter 01 and the paged pool of chapter 03."""

from minipd.kv.block_manager import BlockAllocation, BlockManager
from minipd.kv.contiguous import ContiguousKVCache, KVCache
from minipd.kv.paged_cache import PagedAttentionMetadata, PagedKVCache
from minipd.kv.paged_pool import PagedKVPool

__all__ = ["BlockAllocation", "BlockManager", "ContiguousKVCache", "KVCache", "PagedAttentionMetadata",
           "PagedKVCache", "PagedKVPool"]
