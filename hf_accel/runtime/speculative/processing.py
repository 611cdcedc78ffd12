"""One row's logits processors, called at every draft and verified position of the speculative loop.

Stock ``generate`` calls its ``LogitsProcessorList`` once per token; the loop calls each row's list once per
drafted token and once per verified position, so what the list costs per call is paid ~2x as often, and with
the model-card settings it was ~8% of a call (``LogitsProcessorList`` inspects every processor's signature on
every call; the minimum-length processors build a vocabulary-sized mask on every call, long after the minimum
is reached). :class:`RowProcessors` gives the same scores with less of that work.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Iterable

import torch
from transformers import LogitsProcessorList
from transformers.generation.logits_process import MinLengthLogitsProcessor, MinNewTokensLengthLogitsProcessor

#: Processors that return their input's values unchanged at some prefixes (a copy, in stock), by exact class
#: (a subclass may do more): from the prefix's length on, calling them only costs time.
UNCHANGED_FROM_LENGTH: dict[type, Callable[[Any], int]] = {
    MinLengthLogitsProcessor: lambda p: p.min_length,
    MinNewTokensLengthLogitsProcessor: lambda p: p.prompt_length_to_skip + p.min_new_tokens,
}


class RowProcessors:
    """``processors(input_ids, scores)`` with the values of the ``LogitsProcessorList`` it wraps, for
    ``input_ids`` of one row: each processor in turn, less those that would return the scores unchanged at
    this prefix (:data:`UNCHANGED_FROM_LENGTH`; never one of ``always_called``, the user's own, which stock
    calls every time). A list holding a processor that takes more than ``(input_ids, scores)`` is called as
    it is (stock asks for its extra arguments and raises).

    As with the list, a processor may return ``scores`` itself, or write into it (stock passes its logits and
    returns them with what its processors wrote): pass a clone to keep the logits as they were.

    Example::

        row = RowProcessors(model._get_logits_processor(...))
        scores = row(prefix[None], logits[None].clone())
    """

    def __init__(self, processors: LogitsProcessorList, always_called: Iterable[object] = ()) -> None:
        self.processors = processors
        self._takes_two = all(len(inspect.signature(p.__call__).parameters) <= 2 for p in processors)
        users = {id(p) for p in always_called}
        self._unchanged_from = [None if id(p) in users else UNCHANGED_FROM_LENGTH.get(type(p)) for p in processors]

    def __len__(self) -> int:
        return len(self.processors)

    def __repr__(self) -> str:
        return f"RowProcessors({[type(p).__name__ for p in self.processors]})"

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if not self._takes_two:
            return self.processors(input_ids, scores)
        length = input_ids.shape[-1]
        copy_owed = False
        for processor, unchanged_from in zip(self.processors, self._unchanged_from):
            # The threshold is read on every call, as the processor reads its own settings.
            if unchanged_from is not None and length >= unchanged_from(processor):
                copy_owed = True  # the skipped processor would have returned a copy, which later ones write into
                continue
            if copy_owed:
                scores, copy_owed = scores.clone(), False
            scores = processor(input_ids, scores)
        return scores
