"""A ``transformers.cache_utils.Cache`` that holds only this rank's tokens of an MLA model's latent KV.

Per layer it keeps the latent ``c_kv [B, n_local, kv_lora]`` and the roped ``k_pe [B, n_local, rope]`` of the
columns this rank owns (column ``g`` of the batch's padded sequence is owned by rank ``(g // I) % W``, at local
row ``(g // (I*W))*I + g % I``: DESIGN.md section 3), while :meth:`get_seq_length` and :meth:`get_mask_sizes`
report the *global* length, so transformers' position ids and masks stay its own. With the exact (fp32) indexer
a layer also keeps the owned rows of the indexer's roped keys (:meth:`ShardedLatentLayer.update_index`); the FP8
indexer keeps them in a :class:`peerdcp.IndexKCache` instead.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ...topk import reference as ref

__all__ = ["ShardedLatentLayer", "ShardedLatentCache"]


class ShardedLatentLayer(CacheLayerMixin):
    """One layer's owned latents. ``keys`` is ``c_kv`` and ``values`` is ``k_pe`` (local rows only)."""

    is_sliding = False
    is_croppable = False

    def __init__(self, rank: int, world_size: int, interleave: int = 1) -> None:
        super().__init__()
        for name, v in (("rank", rank), ("world_size", world_size), ("interleave", interleave)):
            if not isinstance(v, int) or isinstance(v, bool):
                raise TypeError(f"ShardedLatentLayer: {name} must be an int, got {type(v).__name__}")
        if world_size < 1 or not 0 <= rank < world_size or interleave < 1:
            raise ValueError(
                f"ShardedLatentLayer: need 0 <= rank < world_size and interleave >= 1, got rank={rank}, "
                f"world_size={world_size}, interleave={interleave}"
            )
        self.rank, self.world_size, self.interleave = rank, world_size, interleave
        self.length = 0  # global columns seen
        self.index_keys: torch.Tensor | None = None  # [B, n_local, D] (exact indexer only)
        self._last = (0, 0)  # global columns of the last update

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B = key_states.shape[0]
        self.keys = key_states.new_empty(B, 0, key_states.shape[-1])
        self.values = value_states.new_empty(B, 0, value_states.shape[-1])
        self.is_initialized = True

    def owned_columns(self, start: int, stop: int, device: torch.device | None = None) -> torch.Tensor:
        """Global columns in ``[start, stop)`` that this rank owns (int64, ascending)."""
        g = torch.arange(start, stop, device=device)
        return g[ref.owner(g, self.world_size, self.interleave) == self.rank]

    def local_columns(self) -> torch.Tensor:
        """``[n_local]`` int64: the global column of each stored row (ascending)."""
        return self.owned_columns(0, self.length, self.keys.device if self.keys is not None else None)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the owned columns of ``c_kv [B, S, kv_lora]`` and roped ``k_pe [B, S, rope]`` (the next S global
        columns); return this rank's whole ``(c_kv, k_pe)`` ``[B, n_local, *]``."""
        if key_states.dim() != 3 or value_states.dim() != 3 or key_states.shape[:2] != value_states.shape[:2]:
            raise ValueError(
                "ShardedLatentLayer.update: expected c_kv [B, S, kv_lora] and k_pe [B, S, rope], got "
                f"{tuple(key_states.shape)} and {tuple(value_states.shape)}"
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[0] != self.keys.shape[0]:
            raise ValueError(
                f"ShardedLatentLayer.update: batch {key_states.shape[0]}, cache holds {self.keys.shape[0]}"
            )
        S = key_states.shape[1]
        mine = self.owned_columns(self.length, self.length + S, key_states.device) - self.length
        self.keys = torch.cat([self.keys, key_states[:, mine]], dim=1)
        self.values = torch.cat([self.values, value_states[:, mine]], dim=1)
        self._last = (self.length, self.length + S)
        self.length += S
        return self.keys, self.values

    def update_index(self, k: torch.Tensor) -> torch.Tensor:
        """Append the owned rows of the indexer keys ``k [B, S, D]`` of the columns of the last :meth:`update`;
        return this rank's ``[B, n_local, D]``."""
        start, stop = self._last
        if k.dim() != 3 or k.shape[1] != stop - start or k.shape[0] != self.keys.shape[0]:
            raise ValueError(
                f"ShardedLatentLayer.update_index: expected [{self.keys.shape[0]}, {stop - start}, D] "
                f"(the columns of the last update), got {tuple(k.shape)}"
            )
        mine = self.owned_columns(start, stop, k.device) - start
        if self.index_keys is None:
            self.index_keys = k.new_empty(k.shape[0], 0, k.shape[-1])
        self.index_keys = torch.cat([self.index_keys, k[:, mine]], dim=1)
        return self.index_keys

    def get_mask_sizes(self, query_length: int, *args) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        if self.is_initialized:
            self.keys, self.values = self.keys[:, :0], self.values[:, :0]
        self.index_keys = None
        self.length, self._last = 0, (0, 0)


class ShardedLatentCache(Cache):
    """The owned-token cache of a whole model: one :class:`ShardedLatentLayer` per decoder layer.

    Args:
        num_layers: decoder layers of the model.
        rank, world_size: this rank's place in the DCP group.
        interleave: ownership interleave I.
    """

    def __init__(self, num_layers: int, rank: int, world_size: int, interleave: int = 1) -> None:
        if not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"ShardedLatentCache: num_layers must be a positive int, got {num_layers!r}")
        super().__init__(layers=[ShardedLatentLayer(rank, world_size, interleave) for _ in range(num_layers)])

    def bytes_local(self) -> int:
        """Bytes of latents this rank holds over all layers."""
        return sum(_nbytes(lay.keys) + _nbytes(lay.values) for lay in self.layers if lay.is_initialized)

    def index_bytes_local(self) -> int:
        """Bytes of exact-indexer keys this rank holds over all layers (0 with the FP8 indexer)."""
        return sum(_nbytes(lay.index_keys) for lay in self.layers if lay.index_keys is not None)


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()
