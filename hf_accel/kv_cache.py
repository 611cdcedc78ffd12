"""A KV cache allocated once and written in place, with O(1) crop for speculative rollback."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

_GROWTH_STEP = 256


class PreallocatedLayer(DynamicLayer):
    """One layer's keys and values in buffers with room to spare.

    ``update`` copies the new states into the buffer (no ``torch.cat`` of the whole history per token) and
    returns views of the filled part; ``crop`` only moves the length. The buffer grows, rarely, by copying.
    """

    def __init__(self, capacity: int = 0) -> None:
        super().__init__()
        self.capacity = capacity
        self.length = 0
        self._keys: torch.Tensor | None = None
        self._values: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self._allocate(key_states, value_states, max(self.capacity, key_states.shape[-2]))
        self.is_initialized = True

    def _allocate(self, key_states: torch.Tensor, value_states: torch.Tensor, capacity: int) -> None:
        capacity = -(-capacity // _GROWTH_STEP) * _GROWTH_STEP
        batch, heads, _, key_dim = key_states.shape
        keys = key_states.new_empty(batch, heads, capacity, key_dim)
        values = value_states.new_empty(batch, heads, capacity, value_states.shape[-1])
        if self._keys is not None and self.length:
            keys[:, :, : self.length] = self._keys[:, :, : self.length]
            values[:, :, : self.length] = self._values[:, :, : self.length]
        self._keys, self._values, self.capacity = keys, values, capacity

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[0] != self._keys.shape[0]:  # a call with another batch size: start over
            self._keys = self._values = None
            self.length = 0
            self._allocate(key_states, value_states, max(key_states.shape[-2], self.capacity))
        start, end = self.length, self.length + key_states.shape[-2]
        if end > self.capacity:
            self._allocate(key_states, value_states, max(end, 2 * self.capacity))
        self._keys[:, :, start:end] = key_states
        self._values[:, :, start:end] = value_states
        self.length = end
        self._expose()
        return self.keys, self.values

    def _expose(self) -> None:
        self.keys = self._keys[:, :, : self.length]
        self.values = self._values[:, :, : self.length]

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of tokens to remove")
        self.length = max(self.length + tokens_to_remove, 0)
        if self.is_initialized:
            self._expose()

    def gather_positions(self, source: torch.Tensor) -> None:
        """Row b's slot t takes what was at slot ``source[b, t]`` (used to realign rows after rollback)."""
        index = source[:, None, :, None]
        self._keys[:, :, : self.length] = self.keys.gather(2, index.expand_as(self.keys))
        self._values[:, :, : self.length] = self.values.gather(2, index.expand(*self.values.shape))
        self._expose()

    def reset(self) -> None:
        self.length = 0
        if self.is_initialized:
            self._expose()


class PreallocatedCache(Cache):
    """A cache of :class:`PreallocatedLayer`; keep it and ``reset()`` it to reuse the memory across calls.

    Example::

        cache = PreallocatedCache(model.config, capacity=1024)
        model.generate(**inputs, past_key_values=cache, max_new_tokens=128)
    """

    def __init__(self, config, capacity: int = 0) -> None:
        layers = config.get_text_config(decoder=True).num_hidden_layers
        super().__init__(layers=[PreallocatedLayer(capacity) for _ in range(layers)])

    @property
    def capacity(self) -> int:
        return min(layer.capacity for layer in self.layers)

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()
