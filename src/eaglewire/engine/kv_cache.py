"""A static key/value cache: preallocated once, written at explicit slots.

Layout: ``k`` and ``v`` are ``[layers, 1, kv_heads, max_len, head_dim]``. A
*slot* is a row along ``max_len``. The cache keeps no length and no cursor: the
caller says where every token goes, which is what tree verification needs.

Contract (the engine relies on it; ``tests/test_lean.py`` proves it):

- ``write`` stores one forward's keys and values at the given slots. Slots need
  not be contiguous; a tree verify step writes its T candidate tokens at
  ``L .. L+T-1`` while their RoPE positions follow tree depth.
- Keys are stored already rotated by their token's RoPE position, so slot ``j``
  is only meaningful for a token whose sequence position is ``j``. After a
  verify step, ``keep(accepted_slots, L)`` moves the accepted tokens (which sit
  at positions ``L, L+1, ...`` along their path) to exactly those slots.
- The valid prefix after ``keep`` is ``[0, L + len(accepted))``. Slots from
  there on are free: they may still hold rejected tokens, and nothing may read
  them before writing them. A forward writes its own slots before it attends,
  and its default causal mask reads only slots up to each token's own slot, so
  decoding after ``keep`` never sees a rejected token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import EaglewireError


class KVCacheError(EaglewireError):
    """A cache operation that would read or write outside the cache or break its contract."""


class KVCache:
    def __init__(self, num_layers: int, kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        shape = (num_layers, 1, kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        # Per-layer views into k/v, built once so the forward's hot loop does no 5-d indexing.
        self.layers = tuple((self.k[i], self.v[i]) for i in range(num_layers))

    def empty_like(self) -> KVCache:
        """A zeroed cache of the same shape, dtype and device (one more sequence in flight)."""
        num_layers, _, kv_heads, max_len, head_dim = self.k.shape
        return KVCache(num_layers, kv_heads, max_len, head_dim, self.k.dtype, self.k.device)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k``, ``v`` [1, kv_heads, T, head_dim] at ``slots`` [T] of ``layer``.

        Returns that layer's whole key and value tensors [1, kv_heads, max_len, head_dim]
        (views, not copies). Bounds are the caller's to check once per forward, not here.
        """
        k_cache, v_cache = self.layers[layer]
        k_cache.index_copy_(2, slots, k)
        v_cache.index_copy_(2, slots, v)
        return k_cache, v_cache

    @torch.inference_mode()
    def keep(self, src_slots: torch.Tensor | Sequence[int], dst_start: int) -> int:
        """Move the entries at ``src_slots`` (in order) to ``dst_start, dst_start+1, ...`` in every layer.

        Overlapping source and destination is fine (the sources are gathered first).
        Returns the new valid length ``dst_start + len(src_slots)``; see the module
        docstring for what that promises about the slots after it.
        """
        src = torch.as_tensor(src_slots, dtype=torch.long, device=self.k.device)
        if src.dim() != 1:
            raise KVCacheError(f"src_slots must be one-dimensional, got shape {tuple(src.shape)}")
        count = src.numel()
        end = dst_start + count
        if dst_start < 0 or end > self.max_len:
            raise KVCacheError(f"cannot keep {count} entries at slots {dst_start}..{end - 1}: the cache has {self.max_len}")
        if count == 0:
            return dst_start
        if int(src.min()) < 0 or int(src.max()) >= self.max_len:
            raise KVCacheError(f"src_slots {src.tolist()} fall outside the cache's {self.max_len} slots")
        if int(src.unique().numel()) != count:
            raise KVCacheError(f"src_slots {src.tolist()} repeat a slot; each kept entry must be a distinct token")
        in_place = torch.arange(dst_start, end, device=src.device)
        if torch.equal(src, in_place):  # a chain accepted where it was written: nothing moves
            return end
        self.k[:, :, :, dst_start:end] = self.k[:, :, :, src]
        self.v[:, :, :, dst_start:end] = self.v[:, :, :, src]
        return end
