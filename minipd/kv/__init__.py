"""Where K and V live between steps: the contiguous cache of chapter 01 and the paged pool of chapter 03."""

from __future__ import annotations

from typing import TYPE_CHECKING

from minipd._lazy import lazy_exports

if TYPE_CHECKING:  # (for type checkers and editors; at run time each name is imported on first use)
    from minipd.kv.block_manager import BlockAllocation, BlockManager
    from minipd.kv.contiguous import ContiguousKVCache, KVCache
    from minipd.kv.paged_cache import PagedAttentionMetadata, PagedKVCache
    from minipd.kv.paged_pool import PagedKVPool

#: Where each public name lives; imported when first asked for, so importing a light module of this
#: package (the scheduler, say) does not pull in torch.
_WHERE = {
    "BlockAllocation": "minipd.kv.block_manager",
    "BlockManager": "minipd.kv.block_manager",
    "ContiguousKVCache": "minipd.kv.contiguous",
    "KVCache": "minipd.kv.contiguous",
    "PagedAttentionMetadata": "minipd.kv.paged_cache",
    "PagedKVCache": "minipd.kv.paged_cache",
    "PagedKVPool": "minipd.kv.paged_pool",
}


__getattr__, __dir__ = lazy_exports(__name__, _WHERE)

__all__ = ["BlockAllocation", "BlockManager", "ContiguousKVCache", "KVCache", "PagedAttentionMetadata", "PagedKVCache",
           "PagedKVPool"]
