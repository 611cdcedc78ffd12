"""A causal LM with its KV cache, advanced by chunks and rolled back per row.

Used for both sides of speculative decoding: the target verifies a chunk of drafted tokens, a draft model
proposes them, and each row of the batch keeps only the tokens it accepted.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from hf_accel.runtime.generation import cache_keyword
from hf_accel.runtime.kv_cache import PreallocatedCache


class CachedLM:
    """``model`` plus its cache and the per-row mask of which cache slots hold real tokens.

    Rows stay right-aligned: each row's real tokens are contiguous and end at the last slot, with padding
    on the left, exactly as a left-padded batch in stock ``generate``. Position ids are each row's count of
    real tokens, as stock ``generate`` computes them, so the numbers match token for token.

    Example::

        lm = CachedLM(model)
        last = lm.prefill(input_ids, attention_mask)       # [batch, vocab]
        logits = lm.extend(next_tokens)                    # [batch, m, vocab]
        lm.keep(torch.tensor([m, 1]))                      # row 0 keeps all m, row 1 keeps one
    """

    def __init__(self, model: torch.nn.Module, cache: Any = None,
                 forward: Callable[..., Any] | None = None, over: CachedLM | None = None) -> None:
        self.model = model
        if over is not None and not can_share(over, model):
            raise ValueError(f"{type(model).__name__} cannot run over the cache of {type(over.model).__name__}: "
                             "it needs a cache of the same kind with layers of the same shapes and dtype")
        #: The CachedLM whose cache this one runs over (a self-draft writing its drafts past the target's
        #: slots), or None: then this one never empties, fills from a prompt, compacts or realigns it, and
        #: gives back every slot it wrote (:meth:`give_back`).
        self.owner = over
        # Full-length layers even for sliding-window models: the window is applied by the attention mask,
        # so rows can be realigned without losing tokens that a trimmed window layer would have dropped.
        self.cache = over.cache if over is not None else cache if cache is not None else PreallocatedCache(model.config)
        if over is None:
            self.cache.reset()
        #: Runs the chunks after the prompt: the model, or a compiled forward over a fixed-length cache.
        self.step = forward if forward is not None else model
        self._fixed_length: int | None = getattr(self.cache, "max_cache_len", None)
        self.mask: torch.Tensor | None = None
        self.realignments = 0  # how often rows were moved (every filled slot may have changed)
        self._supports_logits_to_keep = model._supports_logits_to_keep()

    @property
    def borrowed(self) -> bool:
        """Whether the cache is another CachedLM's (see ``owner``)."""
        return self.owner is not None

    @property
    def fixed_length(self) -> int | None:
        """The slots a fixed-length cache holds (None for one that grows)."""
        return self._fixed_length

    @property
    def batch_size(self) -> int:
        return self.mask.shape[0]

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Run the prompt; the fp32 logits of its last position, ``[batch, vocab]``."""
        self._refuse_if_borrowed("fill from a prompt")
        self.mask = attention_mask.long()
        self._appended = 0
        positions = (self.mask.cumsum(-1) - 1).masked_fill(self.mask == 0, 0)
        return self._forward(input_ids, positions, keep=1, step=self.model)[:, -1]

    def extend(self, ids: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        """Append ``ids`` (``[batch, m]``) to every row; fp32 logits at each of them, ``[batch, m, vocab]``.

        ``valid`` (``[batch, m]``, 1 = real) lets rows append fewer than ``m`` tokens: the others become
        masked slots. Only a drafter uses it, where a hole costs speed but never correctness.
        """
        m = ids.shape[1]
        self.make_room(m)
        chunk_mask = self.mask.new_ones(self.batch_size, m) if valid is None else valid.long()
        positions = self.mask.sum(-1, keepdim=True) + (chunk_mask.cumsum(-1) - 1).clamp_min(0)
        self.mask = torch.cat([self.mask, chunk_mask], dim=-1)
        self._appended += m
        return self._forward(ids, positions, keep=m)

    def make_room(self, m: int) -> None:
        """Make sure ``m`` more slots fit: a fixed-length cache that would overflow packs its rows first."""
        if self._fixed_length is not None and self.mask.shape[1] + m > self._fixed_length:
            self._compact()

    def keep(self, kept: torch.Tensor) -> None:
        """Of the tokens appended since the last ``keep`` (or the prefill), row ``b`` keeps its first
        ``kept[b]``; the rest are forgotten."""
        appended = self._appended
        most = int(kept.max())
        if most < appended:
            self.cache.crop(most - appended)
            self.mask = self.mask[:, : self.mask.shape[1] - (appended - most)]
        shift = most - kept
        if bool((shift > 0).any()):
            self._realign(shift)
        self._appended = 0

    def give_back(self) -> None:
        """Over another's cache: forget every slot written since taking the owner's state, putting the cache's
        write position back at the owner's length (an absolute position, whatever was written)."""
        self.cache.seek(self.owner.mask.shape[1])
        self.mask, self._appended = self.owner.mask.clone(), 0

    def mirror(self, source: CachedLM, start: int = 0) -> None:
        """Hold exactly what ``source`` holds (a model of the same shape: a quantized copy), copying its keys
        and values from slot ``start`` on; the slots before must already be the same. Over ``source``'s own
        cache nothing is copied."""
        end = source.mask.shape[1]
        if self.cache is not source.cache:
            for mine, theirs in zip(self.cache.layers, source.cache.layers):
                mine.mirror(theirs, start, end)
        self.mask = source.mask.clone()
        self._appended = 0

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, keep: int,
                 step: Callable[..., Any] | None = None) -> torch.Tensor:
        step = self.step if step is None else step
        # logits_to_keep=0 means all: a constant, where the chunk's width would be one more number to specialize on.
        kwargs = {"logits_to_keep": 0 if keep == ids.shape[1] else keep} if self._supports_logits_to_keep else {}
        kwargs[cache_keyword(self.model)] = self.cache
        out = step(input_ids=ids, attention_mask=self._full_mask(), position_ids=positions, use_cache=True, **kwargs)
        return out.logits[:, -keep:].float()

    def _full_mask(self) -> torch.Tensor:
        """The mask over every slot the cache attends to: a fixed-length cache's slots past the filled ones
        (free, or holding rolled-back tokens) are masked."""
        if self._fixed_length is None:
            return self.mask
        if self.mask.shape[1] > self._fixed_length:
            raise RuntimeError(f"the static cache holds {self._fixed_length} positions and this call needs more")
        return torch.nn.functional.pad(self.mask, (0, self._fixed_length - self.mask.shape[1]))

    def _compact(self) -> None:
        """Pack each row's real slots to the right, keeping their order, and drop the columns no row uses.

        The mask grows by the most any row keeps per step, so rows that accept fewer tokens gather padding
        (and a drafter's rows holes); a fixed-length cache is sized for one row's tokens, so it packs them
        before it would overflow. For rows without holes this is one shift of every row: slot distances, and
        so sliding windows, are unchanged.
        """
        self._refuse_if_borrowed("compact")
        length = self.mask.shape[1]
        # Stable sort of 0/1: each row's padding and holes first, its real slots after them in their order.
        order = self.mask.argsort(dim=-1, stable=True)
        unused = int((self.mask == 0).sum(-1).min())
        source = order.roll(-unused, dims=-1)  # slot t takes what sorted slot t + unused holds
        for layer in self.cache.layers:
            layer.gather_positions(source)
        self.cache.crop(-unused)
        self.mask = self.mask.gather(1, source)[:, : length - unused]
        self.realignments += 1

    def _realign(self, shift: torch.Tensor) -> None:
        """Move each row's slots right by ``shift[row]``, turning its dropped tail into left padding."""
        self._refuse_if_borrowed("realign")
        length = self.mask.shape[1]
        source = (torch.arange(length, device=shift.device) - shift[:, None]) % length  # [batch, length]
        for layer in self.cache.layers:
            layer.gather_positions(source)
        self.realignments += 1
        self.mask = self.mask.gather(1, source)
        self.mask[torch.arange(length, device=shift.device)[None, :] < shift[:, None]] = 0

    def _refuse_if_borrowed(self, what: str) -> None:
        if self.borrowed:  # the slots are the owner's: this would move or fill them under the owner's mask
            raise RuntimeError(f"a CachedLM over another's cache cannot {what} it; the owner makes room first")


def can_share(owner: CachedLM, model: torch.nn.Module) -> bool:
    """Whether ``model`` can run over ``owner``'s cache: a cache that can seek back, and a model whose keys and
    values have the owner's shapes and dtype in every layer (a quantized copy of the owner's model)."""
    if not hasattr(owner.cache, "seek") or getattr(model, "dtype", None) != getattr(owner.model, "dtype", None):
        return False
    mine, theirs = (m.config.get_text_config(decoder=True) for m in (model, owner.model))
    fields = ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size",
              "layer_types", "sliding_window")
    return all(getattr(mine, f, None) == getattr(theirs, f, None) for f in fields)
