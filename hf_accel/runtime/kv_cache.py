"""KV caches allocated once and written in place, with O(1) crop for speculative rollback: one that
exposes only its filled part (eager forwards), and a fixed-length one for compiled forwards."""

from __future__ import annotations

import abc
import logging
import math
from collections import OrderedDict
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer, StaticLayer

from hf_accel.runtime.compile_gate import is_tracing

_GROWTH_STEP = 256
#: Batch sizes whose fixed-length caches a compiled step keeps between calls; the least recently used one beyond
#: is freed.
CACHES_KEPT = 4

logger = logging.getLogger(__name__)


class PreallocatedLayer(DynamicLayer):
    """One layer's keys and values in buffers with room to spare.

    ``update`` copies the new states into the buffer (no ``torch.cat`` of the whole history per token) and
    returns views of the filled part; ``crop`` only moves the length. The buffer grows, rarely, by copying.
    Subclasses may store states in another form by overriding ``encode`` and ``decode``.
    """

    def __init__(self, capacity: int = 0) -> None:
        super().__init__()
        self.capacity = capacity
        self.length = 0
        self._stores: dict[str, list[torch.Tensor]] | None = None

    # -- how states are stored ------------------------------------------------------------------------------
    def encode(self, states: torch.Tensor) -> list[torch.Tensor]:
        """The tensors that store ``states`` (``[batch, heads, n, dim]``), each indexed by position on dim 2."""
        return [states]

    def decode(self, parts: list[torch.Tensor]) -> torch.Tensor:
        return parts[0]

    # -- cache protocol -------------------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self._allocate(key_states, value_states, max(self.capacity, key_states.shape[-2]))
        self.is_initialized = True

    def _allocate(self, key_states: torch.Tensor, value_states: torch.Tensor, capacity: int) -> None:
        capacity = -(-capacity // _GROWTH_STEP) * _GROWTH_STEP
        stores = {}
        for kind, states in (("keys", key_states), ("values", value_states)):
            parts = self.encode(states[:, :, :1])
            stores[kind] = [p.new_empty(*p.shape[:2], capacity, *p.shape[3:]) for p in parts]
            if self._stores is not None and self.length:
                for new, old in zip(stores[kind], self._stores[kind]):
                    new[:, :, : self.length] = old[:, :, : self.length]
        self._stores, self.capacity = stores, capacity

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self._write(key_states, value_states)
        return self.keys, self.values

    def mirror(self, source: CacheLayerMixin, start: int, end: int) -> None:
        """Hold what ``source`` holds in its first ``end`` slots, copying only slots ``start`` onwards."""
        self._write(source.keys[:, :, start:end], source.values[:, :, start:end], start)

    def _write(self, key_states: torch.Tensor, value_states: torch.Tensor, start: int | None = None) -> None:
        """Store the states at slots ``start`` onwards (default: after the filled ones); the layer then holds
        every slot up to the last one written, and none after."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[0] != self._stores["keys"][0].shape[0]:  # a call with another batch size: start over
            self._stores, self.length = None, 0
            self._allocate(key_states, value_states, max(key_states.shape[-2], self.capacity))
        start = self.length if start is None else start
        end = start + key_states.shape[-2]
        if end > self.capacity:
            self._allocate(key_states, value_states, max(end, 2 * self.capacity))
        for kind, states in (("keys", key_states), ("values", value_states)):
            for buffer, part in zip(self._stores[kind], self.encode(states)):
                buffer[:, :, start:end] = part
        self.length = end
        self._expose()

    def _expose(self) -> None:
        self.keys = self.decode([b[:, :, : self.length] for b in self._stores["keys"]])
        self.values = self.decode([b[:, :, : self.length] for b in self._stores["values"]])

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
        for buffers in self._stores.values():
            for buffer in buffers:
                filled = buffer[:, :, : self.length]
                index = source[:, None, :, None].expand(*filled.shape)
                buffer[:, :, : self.length] = filled.gather(2, index)
        self._expose()

    def reset(self) -> None:
        self.length = 0
        if self.is_initialized:
            self._expose()

    def release(self) -> None:
        self._stores, self.length, self.is_initialized = None, 0, False
        self.keys = self.values = None

    def stored_bytes_per_token(self) -> int:
        """Bytes one position takes in this layer, keys and values, all rows."""
        if self._stores is None:
            return 0
        return sum(b[:, :, 0].numel() * b.element_size() for parts in self._stores.values() for b in parts)


class RollbackCache(Cache, metaclass=abc.ABCMeta):
    """What the speculative loop needs of a cache, besides transformers' ``Cache``: emptied for the next call
    (``reset``), its filled length set (``seek``: rolled back, or moved past another model's drafts), and
    layers that copy another cache's slots (``mirror``) and keep chosen positions per row
    (``gather_positions``). A kv_cache backend installs one; the compiled step's caches are these too."""

    @abc.abstractmethod
    def reset(self) -> None: ...

    @abc.abstractmethod
    def seek(self, length: int) -> None: ...


class PreallocatedCache(RollbackCache):
    """A cache of :class:`PreallocatedLayer`; keep it and ``reset()`` it to reuse the memory across calls.

    Example::

        cache = PreallocatedCache(model.config, capacity=1024)
        model.generate(**inputs, cache=cache, max_new_tokens=128)   # past_key_values= before transformers 5.24
    """

    def __init__(self, config, capacity: int = 0, layer_class: type[PreallocatedLayer] = PreallocatedLayer) -> None:
        layers = config.get_text_config(decoder=True).num_hidden_layers
        super().__init__(layers=[layer_class(capacity) for _ in range(layers)])

    @property
    def capacity(self) -> int:
        return min(layer.capacity for layer in self.layers)

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()

    def seek(self, length: int) -> None:
        """Make the first ``length`` slots the filled ones (the next update writes after them)."""
        for layer in self.layers:
            layer.length = length
            if layer.is_initialized:
                layer._expose()

    def release(self) -> None:
        """Free the buffers; the next call allocates what it needs again."""
        for layer in self.layers:
            layer.release()

    def bytes_per_token(self) -> int:
        return sum(layer.stored_bytes_per_token() for layer in self.layers)

    def stored_bytes(self) -> int:
        """Bytes the cache holds now (its allocated capacity, every layer)."""
        return sum(b.numel() * b.element_size() for layer in self.layers if layer._stores
                   for parts in layer._stores.values() for b in parts)


class BufferPool:
    """Flat buffers that one model's fixed-length caches take their keys and values from, as contiguous views.

    A model runs one ``generate`` call at a time (under its lock) and each call resets and refills its cache,
    so caches kept for other batch sizes can share memory: the pool holds, per layer and kind, the largest
    buffer any cache asked for, not one per batch size. New buffers are zeroed (masked slots are multiplied
    by zero attention weights, which must not meet a NaN bit pattern).
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}

    def take(self, key: tuple[Any, ...], shape: tuple[int, ...], dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
        numel, slot = math.prod(shape), (*key, dtype, device)
        buffer = self._buffers.get(slot)
        if buffer is None or buffer.numel() < numel:
            # The old one goes before the larger one is allocated (unless a cache still views it).
            buffer = None
            self._buffers.pop(slot, None)
            buffer = self._buffers[slot] = torch.zeros(numel, dtype=dtype, device=device)
        return buffer[:numel].view(shape)

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in list(self._buffers.values()))


class RollbackStaticLayer(StaticLayer):
    """transformers' compileable ``StaticLayer`` (fixed-size buffers written at a tensor index), which can also
    move its index back and permute positions per row, both in place, for speculative rollback. Given a
    :class:`BufferPool` (and its index in the cache), it takes its buffers from the pool."""

    is_croppable = True

    def __init__(self, max_cache_len: int, pool: BufferPool | None = None, index: int = 0) -> None:
        super().__init__(max_cache_len)
        self.pool, self.index = pool, index

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if self.pool is None:
            return super().lazy_initialization(key_states, value_states)
        self.device = key_states.device
        self.batch_size, self.num_heads = key_states.shape[:2]
        self.k_head_dim, self.v_head_dim = key_states.shape[-1], value_states.shape[-1]
        self.keys, self.values = (
            self.pool.take((self.index, kind), (self.batch_size, self.num_heads, self.max_cache_len, dim),
                           states.dtype, self.device)
            for kind, states, dim in (("keys", key_states, self.k_head_dim), ("values", value_states,
                                                                               self.v_head_dim)))
        self.cumulative_length = self.cumulative_length.to(self.device)
        if not is_tracing():  # fixed addresses, for CUDA graphs (as StaticLayer marks them)
            for tensor in (self.keys, self.values, self.cumulative_length):
                torch._dynamo.mark_static_address(tensor)
        self.is_initialized = True

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of tokens to remove")
        self.cumulative_length.add_(tokens_to_remove).clamp_(min=0)

    def mirror(self, source: CacheLayerMixin, start: int, end: int) -> None:
        """Hold what ``source`` holds in its first ``end`` slots, copying only slots ``start`` onwards."""
        if not self.is_initialized:
            self.lazy_initialization(source.keys, source.values)
        self.keys[:, :, start:end].copy_(source.keys[:, :, start:end])
        self.values[:, :, start:end].copy_(source.values[:, :, start:end])
        self.cumulative_length.fill_(end)

    def gather_positions(self, source: torch.Tensor) -> None:
        """Row b's slot t takes what was at slot ``source[b, t]`` for the filled slots (see ``CachedLM``)."""
        if not self.is_initialized:
            return
        length = source.shape[1]
        for buffer in (self.keys, self.values):
            filled = buffer[:, :, :length]
            filled.copy_(filled.gather(2, source[:, None, :, None].expand(*filled.shape)))


class RollbackStaticCache(RollbackCache):
    """A fixed-length cache of :class:`RollbackStaticLayer` (every layer full length, sliding-window ones
    too, so rows can be realigned; the window is applied by the mask): the cache of every decode step that
    runs through a compiled step (stock ``generate``'s and the speculative loop's). The attention mask given
    with it spans all ``max_cache_len`` slots.

    Example::

        cache = RollbackStaticCache(model.config, max_cache_len=512)
        lm = CachedLM(model, cache)
    """

    def __init__(self, config, max_cache_len: int, pool: BufferPool | None = None) -> None:
        layers = config.get_text_config(decoder=True).num_hidden_layers
        super().__init__(layers=[RollbackStaticLayer(max_cache_len, pool, i) for i in range(layers)])
        self.max_cache_len = max_cache_len

    def reset(self) -> None:
        for layer in self.layers:  # no need to zero the buffers: slots past the index are masked
            layer.cumulative_length.zero_()

    def seek(self, length: int) -> None:
        """Make the next update write at slot ``length`` (the slots before it are the filled ones)."""
        for layer in self.layers:
            layer.cumulative_length.fill_(length)


class BucketedCaches:
    """The fixed-length caches a compiled decode step runs over (a base of
    :class:`~hf_accel.runtime.compiled_step.CompiledDecodeStep`): one per batch size, the most recent
    :data:`CACHES_KEPT` kept, their lengths a multiple of ``bucket``, all viewing one :class:`BufferPool`."""

    model: Any
    bucket: int

    def _init_caches(self) -> None:
        self._caches: OrderedDict[int, tuple[int, Cache]] = OrderedDict()  # batch size -> (positions, cache)
        self._pool, self._pool_positions = BufferPool(), 0  # what the caches view; its largest batch x length

    def cache_for(self, batch_size: int, needed_length: int) -> RollbackStaticCache:
        """The cache for this batch size, emptied; made anew (one bucket longer) only when it is too short.
        A :class:`~hf_accel.runtime.kv_cache.RollbackStaticCache`: full-length layers (the sliding window is applied
        by the mask) that the speculative loop can crop and realign. Every cache of this step views one
        :class:`~hf_accel.runtime.kv_cache.BufferPool` (one call runs at a time), so the memory is that of the largest
        batch times length asked for, not one cache per batch size."""
        length, cache = self._caches.pop(batch_size, (0, None))
        if cache is None or length < needed_length:
            length = -(-needed_length // self.bucket) * self.bucket
            if batch_size * length > self._pool_positions:  # the pool grows: let go of views of the old buffers
                self._caches.clear()
                self._pool_positions = batch_size * length
            cache = RollbackStaticCache(self.model.config, max_cache_len=length, pool=self._pool)
            logger.debug("static cache for batch %d: %d positions", batch_size, length)
        else:
            cache.reset()
        self._caches[batch_size] = (length, cache)  # the most recently used, last
        while len(self._caches) > CACHES_KEPT:
            evicted, _ = self._caches.popitem(last=False)
            logger.debug("static cache for batch %d forgotten (least recently used)", evicted)
        return cache

    def cache_bytes(self) -> int:
        """Bytes the caches' shared buffers hold (keys and values, every layer)."""
        return self._pool.nbytes()
