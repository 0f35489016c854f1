"""Key/value caches of TokenSwift: the full cache verification uses and the drafter's dynamic cache.

Both are handed to a transformers model as ``past_key_values``: the model calls ``update(k, v, layer)`` once
per layer per forward with the new entries [1, Hkv, q, D] (RoPE applied) and attends over what it returns.
The new entries stay *pending* until the caller decides what to keep (``commit``).

- ``KVCache``: every committed position, in per-layer buffers [1, Hkv, cap, D] that double when full, so an
  append is a slice write (no concatenation of the whole cache per token). A tree verification keeps the
  root and the accepted path (``commit(keep)`` packs them behind the committed entries).
- ``DynamicDraftCache``: the drafter's fixed budget |B| (the paper's section 3): the first |S| positions
  (attention sinks) always, plus the |B|-|S| most important others, per layer and KV head. Importance of
  entry i is the drafter's newest query against its key, summed over the query heads sharing the key (GQA:
  K is never repeated; sum_j q_j.k_i = (sum_j q_j).k_i). Newly committed entries (exact K/V copied from the
  full cache) replace the least important ones and are protected until the next rebuild; once more than
  ``rebuild_every`` (default |S|) entries were replaced, all scores are recomputed and the top |B|-|S| are
  gathered again. While the full cache fits the budget, the draft cache mirrors it exactly.
"""
from __future__ import annotations

import torch


class KVCache:
    """Growable full K/V cache; ``length`` committed entries, ``pending`` from the current forward."""

    def __init__(self, capacity: int = 1024):
        if capacity < 1:
            raise ValueError(f"KVCache: capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.keys: list[torch.Tensor] = []    # per layer [1, Hkv, cap, D]
        self.values: list[torch.Tensor] = []
        self.length = 0
        self.pending = 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def _ensure(self, layer: int, like: torch.Tensor, end: int) -> None:
        if layer == len(self.keys):
            shape = (*like.shape[:2], max(self.capacity, end), like.shape[3])
            self.keys.append(like.new_empty(shape))
            self.values.append(like.new_empty(shape))
        elif self.keys[layer].shape[2] < end:
            for store in (self.keys, self.values):
                old = store[layer]
                new = old.new_empty((*old.shape[:2], max(2 * old.shape[2], end), old.shape[3]))
                new[:, :, : self.length] = old[:, :, : self.length]
                store[layer] = new

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write key/value [1, Hkv, q, D] after the committed entries; return [1, Hkv, length + q, D] views."""
        end = self.length + key.shape[2]
        self._ensure(layer_idx, key, end)
        self.keys[layer_idx][:, :, self.length:end] = key
        self.values[layer_idx][:, :, self.length:end] = value
        self.pending = key.shape[2]
        return self.keys[layer_idx][:, :, :end], self.values[layer_idx][:, :, :end]

    def commit(self, keep: list[int] | None = None) -> None:
        """Keep all pending entries (None) or those at the given offsets into the pending block, in order."""
        if keep is None:
            self.length += self.pending
        elif keep != list(range(len(keep))):  # otherwise the kept entries are already in place
            idx = torch.tensor(keep, device=self.keys[0].device) + self.length
            for store in (self.keys, self.values):
                for buf in store:
                    buf[:, :, self.length:self.length + len(keep)] = buf.index_select(2, idx)
            self.length += len(keep)
        else:
            self.length += len(keep)
        self.pending = 0

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Committed K, V of layer i: [1, Hkv, length, D] views."""
        return self.keys[i][:, :, : self.length], self.values[i][:, :, : self.length]

    @property
    def num_layers(self) -> int:
        return len(self.keys)


def group_scores(query: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Importance of every key for the newest query: query [1, Hq, 1, D], keys [1, Hkv, L, D] -> [1, Hkv, L]
    = sum over the Hq/Hkv query heads of a group of q_j.k_i (computed as (sum_j q_j).k_i, K not repeated)."""
    b, hq, _, d = query.shape
    hkv = keys.shape[1]
    qsum = query[:, :, -1].reshape(b, hkv, hq // hkv, d).sum(2)  # [1, Hkv, D]
    return torch.einsum("bhd,bhld->bhl", qsum.float(), keys.float())


class DynamicDraftCache:
    """The drafter's budgeted view of a ``KVCache`` (see the module docstring)."""

    def __init__(self, budget: int, sinks: int, rebuild_every: int | None = None):
        rebuild_every = sinks if rebuild_every is None else rebuild_every
        if sinks < 0 or rebuild_every < 1:
            raise ValueError(f"dynamic cache: need sinks >= 0 and rebuild_every >= 1, got {sinks}, {rebuild_every}")
        if budget <= sinks + rebuild_every:
            raise ValueError(f"dynamic cache: budget {budget} must exceed sinks {sinks} + rebuild_every "
                             f"{rebuild_every} (the entries protected between rebuilds)")
        self.budget, self.sinks, self.rebuild_every = budget, sinks, rebuild_every
        self.keys: list[torch.Tensor] = []     # per layer [1, Hkv, budget + 1, D] (last slot: pending entry)
        self.values: list[torch.Tensor] = []
        self.scores: list[torch.Tensor] = []   # per layer [1, Hkv, budget] float32, sinks/new entries +inf
        self.positions: list[torch.Tensor] = []  # per layer [1, Hkv, budget] source position in the full cache
        self.length = 0      # filled slots (same for every layer and head)
        self.seen = 0        # full-cache entries already reflected here
        self.replaced = 0    # entries replaced since the last rebuild
        self.rebuilds = 0
        self.pending = 0

    # --- transformers cache protocol (the draft forward) ---
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Attend over the budgeted entries plus the new ones; the new ones are never kept (see ``sync``)."""
        q = key.shape[2]
        if q > 1:
            return (torch.cat([self.keys[layer_idx][:, :, : self.length], key], 2),
                    torch.cat([self.values[layer_idx][:, :, : self.length], value], 2))
        self.keys[layer_idx][:, :, self.length:self.length + 1] = key
        self.values[layer_idx][:, :, self.length:self.length + 1] = value
        return self.keys[layer_idx][:, :, : self.length + 1], self.values[layer_idx][:, :, : self.length + 1]

    # --- keeping up with the full cache ---
    def sync(self, full: KVCache, queries: dict[int, torch.Tensor]) -> None:
        """Reflect the entries committed to ``full`` since the last call; ``queries`` = the drafter's newest
        query per layer ([1, Hq, q, D], last row used) for importance scores."""
        new = full.length - self.seen
        if new <= 0:
            return
        if not self.keys:
            self._allocate(full)
        if full.length <= self.budget:
            self._mirror(full)
        elif self.length < self.budget or self.replaced + new > self.rebuild_every:
            self.rebuild(full, queries)
        else:
            self._insert(full, new)
        self.seen = full.length

    def _allocate(self, full: KVCache) -> None:
        for k in full.keys:
            shape = (*k.shape[:2], self.budget + 1, k.shape[3])
            self.keys.append(k.new_zeros(shape))
            self.values.append(k.new_zeros(shape))
            self.scores.append(torch.full((*k.shape[:2], self.budget), float("inf"), device=k.device))
            self.positions.append(torch.zeros((*k.shape[:2], self.budget), dtype=torch.long, device=k.device))

    def _mirror(self, full: KVCache) -> None:
        n = full.length
        for i in range(full.num_layers):
            k, v = full.layer(i)
            self.keys[i][:, :, :n] = k
            self.values[i][:, :, :n] = v
            self.positions[i][:, :, :n] = torch.arange(n, device=k.device)
            self.scores[i][:, :, :n] = float("inf")
        self.length = n

    def rebuild(self, full: KVCache, queries: dict[int, torch.Tensor]) -> None:
        """Sinks + the top |B|-|S| other full-cache entries by group-summed query.key score, per layer/head."""
        s, top = self.sinks, self.budget - self.sinks
        for i in range(full.num_layers):
            k, v = full.layer(i)  # [1, Hkv, L, D]
            score = group_scores(queries[i], k[:, :, s:])  # [1, Hkv, L-S]
            best, idx = score.topk(top, -1)  # [1, Hkv, B-S]
            idx, order = idx.sort(-1)  # keep sequence order
            best = best.gather(-1, order)
            pos = idx + s
            gather = pos[..., None].expand(-1, -1, -1, k.shape[3])
            self.keys[i][:, :, :s] = k[:, :, :s]
            self.values[i][:, :, :s] = v[:, :, :s]
            self.keys[i][:, :, s:self.budget] = k.gather(2, gather)
            self.values[i][:, :, s:self.budget] = v.gather(2, gather)
            self.positions[i][:, :, :s] = torch.arange(s, device=k.device)
            self.positions[i][:, :, s:] = pos
            self.scores[i][:, :, :s] = float("inf")
            self.scores[i][:, :, s:] = best
        self.length = self.budget
        self.replaced = 0
        self.rebuilds += 1

    def _insert(self, full: KVCache, new: int) -> None:
        """The ``new`` newest full-cache entries replace the least important slots (per layer and head)."""
        lo = full.length - new
        for i in range(full.num_layers):
            k, v = full.layer(i)
            _, slot = self.scores[i].topk(new, -1, largest=False)  # [1, Hkv, new]
            gather = slot[..., None].expand(-1, -1, -1, k.shape[3])
            src_k = k[:, :, lo:]  # [1, Hkv, new, D]
            self.keys[i][:, :, : self.budget].scatter_(2, gather, src_k)
            self.values[i][:, :, : self.budget].scatter_(2, gather, v[:, :, lo:])
            self.scores[i].scatter_(-1, slot, float("inf"))
            self.positions[i].scatter_(-1, slot, torch.arange(lo, full.length, device=k.device).expand_as(slot))
        self.replaced += new
