"""Where K and V live between steps. Chapter 03 starts from the contiguous cache kept here."""

from minipd.kv.contiguous import ContiguousKVCache, KVCache

__all__ = ["ContiguousKVCache", "KVCache"]
