"""Reading a ``generate`` call as stock would: what the speculative loop needs to run it exactly (each row's
processors, the stopping criteria, the token budget), or why it cannot."""

from __future__ import annotations

import copy
import inspect
import reprlib
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig, GenerationMixin, LogitsProcessorList, StoppingCriteriaList

from hf_accel.runtime.generation import generated_length
from hf_accel.runtime.speculative.processing import RowProcessors
from hf_accel.runtime.speculative.settings import blocking_settings, returns_scores, stops_without_eos

#: Model inputs a call may pass besides the token ids (anything else falls back to stock generate).
_MODEL_INPUTS = frozenset({"input_ids", "attention_mask", "logits_to_keep"})
#: Stock generate's parameters a call may pass by position, in order (``self`` left out), as this transformers
#: version declares them: the loop reads a call as stock's generate would.
_GENERATE_ARGS = tuple(p.name for p in inspect.signature(GenerationMixin.generate).parameters.values()
                       if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD)[1:]


@dataclass(frozen=True)
class Fallback:
    """Why the loop cannot run a call exactly (the report counts calls per ``reason``), and what the user can
    change to keep speculation. ``stock_raises``: stock ``generate`` refuses the call itself, and says why."""

    reason: str
    remedy: str
    stock_raises: bool = False


_STOCK_RAISES_FOR_STOP_STRINGS = Fallback("stop_strings without tokenizer= (stock generate raises for it)",
                                          "pass tokenizer= with stop_strings", stock_raises=True)
_STOCK_RAISES_FOR_SEQUENCES = Fallback("num_return_sequences > 1 without sampling (stock generate raises for it)",
                                       "sample (do_sample=True) for several sequences per prompt", stock_raises=True)
_STOCK_RAISES_FOR_INPUTS = Fallback("inputs and input_ids both passed (stock generate raises for it)",
                                    "pass the token ids once", stock_raises=True)
_POSITIONAL = Fallback("positional arguments stock generate has no room for (too many, or also given by name)",
                      "pass generate's arguments by name")
_STOCK_RAISES_FOR_POSITIONAL = Fallback("positional arguments stock generate has no room for (stock generate raises "
                                        "for them)", "pass generate's arguments by name", stock_raises=True)
_STOCK_RAISES_FOR_MODEL_KWARGS = Fallback("generate arguments the model does not take (stock generate raises "
                                          "for them)", "fix the argument's name", stock_raises=True)
#: transformers continues each row's position ids from its prompt's last column; where that is padding, stock's
#: positions are no count of the row's tokens, which is what the loop's cache numbers them by.
RIGHT_PADDED = Fallback("a prompt padded on the right (a row ends in padding; transformers warns that decoder-only "
                        "models generate wrongly from it)",
                        "pad prompts on the left (tokenizer.padding_side='left'), as transformers asks")
_STOCK_RAISES_FOR_MASK = Fallback("an attention_mask of another shape than the input ids (stock generate raises "
                                  "for it)", "pass an attention_mask of the input ids' [batch, length]",
                                  stock_raises=True)
_NOT_COVERED = ("synced_gpus", "assistant_model", "negative_prompt_ids", "negative_prompt_attention_mask",
                "custom_generate", "assistant_tokenizer")


@dataclass
class CallPlan:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    config: GenerationConfig
    processors: list[RowProcessors]  # one list per row
    draft_processors: list[RowProcessors]  # the same without the user's own (a drafter's calls are extra)
    stopping: StoppingCriteriaList | None
    streamer: Any
    max_new_tokens: int


def plan_call(model: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> CallPlan | Fallback:
    """Read a ``generate`` call as stock would; a :class:`Fallback` says why the loop cannot run it exactly."""
    named = dict(zip(_GENERATE_ARGS, args))
    if len(args) > len(_GENERATE_ARGS) or set(named) & set(kwargs):
        # A model class's own generate may take what stock's has no room for.
        return _POSITIONAL if type(model).generate is not GenerationMixin.generate else _STOCK_RAISES_FOR_POSITIONAL
    named.update(kwargs)
    named.pop("trust_remote_code", None)  # stock's too: it only lets custom_generate load code (not covered)
    for name in _NOT_COVERED:
        value = named.pop(name, None)
        if value is not None and value is not False:  # synced_gpus=False is stock's default
            return Fallback(f"generate argument {name!r}", f"drop {name}= from the call")
    input_ids = named.pop("inputs", None)
    if input_ids is None:
        input_ids = named.pop("input_ids", None)
    elif named.pop("input_ids", None) is not None:
        return _STOCK_RAISES_FOR_INPUTS
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
        return Fallback("inputs other than a [batch, length] tensor of token ids",
                        "pass input_ids as a [batch, length] tensor of token ids")
    if model.config.is_encoder_decoder:
        return Fallback("encoder-decoder models",
                        "patch with speculative=None (the loop drafts for decoder-only models only)")
    extra = {k: named.pop(k, None)
             for k in ("logits_processor", "stopping_criteria", "streamer", "prefix_allowed_tokens_fn", "tokenizer")}
    call_settings = dict(named)
    config, model_kwargs = model._prepare_generation_config(named.pop("generation_config", None), **named)
    attention_mask = model_kwargs.pop("attention_mask", None)
    why = unsupported_setting(model, config, model_kwargs)
    if why:
        return why
    max_new = generated_length(model, config, call_settings, input_ids)  # sets min_length as stock does too
    if max_new < 1:
        return Fallback("no tokens to generate (max_length <= prompt length; stock generate raises for it)",
                        "ask for new tokens with max_new_tokens (max_length counts the prompt)", stock_raises=True)
    if config.pad_token_id is None:
        eos = config.eos_token_id
        config.pad_token_id = eos[0] if isinstance(eos, list) else eos
    if attention_mask is None:
        attention_mask = _infer_attention_mask(input_ids, config)
    elif attention_mask.shape != input_ids.shape:
        return _STOCK_RAISES_FOR_MASK
    copies = max(1, config.num_return_sequences)  # stock expands by max(num_beams, num_return_sequences)
    if copies > 1:
        if not config.do_sample:  # stock refuses it without beams; let it say so
            return _STOCK_RAISES_FOR_SEQUENCES
        input_ids = input_ids.repeat_interleave(copies, dim=0)
        attention_mask = attention_mask.repeat_interleave(copies, dim=0)
    one_row = _one_row(config)
    if extra["streamer"] is not None and input_ids.shape[0] > 1:
        return Fallback("a streamer with batch > 1 (streamers take one row)", one_row + " when streaming")
    if returns_scores(config) and input_ids.shape[0] > 1:
        return Fallback("output_scores/output_logits with batch > 1",
                        one_row + ", or without output_scores/output_logits")
    if extra["tokenizer"] is None and config.stop_strings:
        return _STOCK_RAISES_FOR_STOP_STRINGS
    if stops_without_eos(config) and input_ids.shape[0] > 1:
        return Fallback("stop_strings with batch > 1 and no eos_token_id",
                        "set an eos_token_id (rows that stop are then padded with it, as stock pads them), "
                        "or " + one_row)
    for name in ("logits_processor", "stopping_criteria"):
        if extra[name] and input_ids.shape[0] > 1:
            # Built-in processors are built per row; a user's object is one for the whole batch and may read
            # rows by index or keep per-row state, so calling it one row at a time could change its answers.
            return Fallback(f"a {name} of your own with batch > 1 (the loop calls it one row at a time)",
                            one_row + ", or express it as a generation setting where one exists")
    model._prepare_special_tokens(config, True, input_ids.device)
    # Each row's processors are built and called as a batch of one (the prompt row it came from, for
    # prefix_allowed_tokens_fn: stock numbers expanded rows by their prompt).
    row_config = copy.copy(config)
    row_config.num_return_sequences = 1
    processors = [_row_processors(model, row_config, input_ids, attention_mask, b, b // copies,
                                  extra) for b in range(len(input_ids))]
    # The user's processors and prefix_allowed_tokens_fn see exactly stock's calls; a drafter's would be extra
    # ones, about prefixes stock never builds (past an EOS, or a draft later rejected).
    users = {"logits_processor": None, "prefix_allowed_tokens_fn": None}
    draft_processors = processors if not any(extra[k] for k in users) else [
        _row_processors(model, row_config, input_ids, attention_mask, b, b // copies,
                        {**extra, **users}) for b in range(len(input_ids))]
    # Stock's criteria (lengths, EOS, stop strings, time) merged with the user's as stock merges them; the loop
    # checks them per row after each token, but the time once per step for the whole batch, as stock does.
    stopping = model._get_stopping_criteria(config, StoppingCriteriaList(extra["stopping_criteria"] or []),
                                            tokenizer=extra["tokenizer"])
    if bool((attention_mask[:, -1] == 0).any()):  # last: a call stock refuses (as it builds these) gets its error
        return RIGHT_PADDED
    return CallPlan(input_ids, attention_mask, config, processors, draft_processors, stopping, extra["streamer"],
                    max_new)


def _row_processors(model: Any, config: GenerationConfig, input_ids: torch.Tensor, mask: torch.Tensor, row: int,
                    prompt: int, extra: dict[str, Any]) -> RowProcessors:
    """Stock's processor list for one row of the call, as ``generate`` would build it for the batch: the user's
    merged with those the settings ask for. Built per row because some processors hold per-row state (the
    row's padding, for the repetition penalty) or ask a function about their row by index."""
    allowed = extra["prefix_allowed_tokens_fn"]
    return RowProcessors(model._get_logits_processor(
        generation_config=config, input_ids_seq_length=input_ids.shape[1], encoder_input_ids=input_ids[row:row + 1],
        prefix_allowed_tokens_fn=None if allowed is None else (lambda _, prefix: allowed(prompt, prefix)),
        logits_processor=LogitsProcessorList(extra["logits_processor"] or []), device=input_ids.device,
        model_kwargs={"attention_mask": mask[row:row + 1]}), always_called=extra["logits_processor"] or ())


def _one_row(config: GenerationConfig) -> str:
    """The remedy for what the loop runs for one row only (expanded rows count as rows)."""
    if config.num_return_sequences > 1:
        return "call generate with one prompt at a time and num_return_sequences=1"
    return "call generate with one row at a time"


def _infer_attention_mask(input_ids: torch.Tensor, config: GenerationConfig) -> torch.Tensor:
    """Stock's rule: the pad token marks padding, unless it is also the EOS token."""
    pad, eos = config.pad_token_id, config.eos_token_id
    eos_ids = eos if isinstance(eos, list) else [eos]
    if pad is not None and pad not in eos_ids and bool((input_ids == pad).any()):
        return input_ids.ne(pad).long()
    return torch.ones_like(input_ids)


def unsupported_setting(model: Any, config: GenerationConfig, model_kwargs: dict[str, Any]) -> Fallback | None:
    """What in a call the loop cannot reproduce exactly (see :mod:`hf_accel.runtime.speculative.settings`), or None."""
    blocking = blocking_settings(config)
    if blocking:
        key, _, why = blocking[0]  # counted by the first setting, whatever its value
        every = ", ".join(f"{k}={_short(v)}" for k, v, _ in blocking)  # dropping one must not reveal another
        return Fallback(f"generation setting {key} ({why})",
                        f"drop {every} from the call (or from the model's generation_config)")
    extra = sorted(k for k, v in model_kwargs.items() if k not in _MODEL_INPUTS and v is not None)
    if not extra:
        return None
    if _refused_by_stock(model, model_kwargs):
        return _STOCK_RAISES_FOR_MODEL_KWARGS
    return Fallback(f"generate argument {extra[0]!r}",
                    f"the loop reads token ids only: drop {extra[0]}= where the model does not need it")


def _short(value: Any) -> str:
    """A setting's value as a warning shows it: a model card's long list cut short."""
    shortened = reprlib.Repr()
    shortened.maxlist = shortened.maxdict = shortened.maxtuple = 4
    shortened.maxstring = shortened.maxother = 40
    return shortened.repr(value)


#: Deprecated names of ``cache`` that stock's ``generate`` renames before it checks the other arguments.
_RENAMED_BY_STOCK = ("past_key_values", "cache_params")


def _refused_by_stock(model: Any, model_kwargs: dict[str, Any]) -> bool:
    """Whether stock ``generate`` refuses an argument no model function takes (a misspelt one): its own check,
    on what it checks."""
    try:
        model._validate_model_kwargs({k: v for k, v in model_kwargs.items() if k not in _RENAMED_BY_STOCK})
    except ValueError:
        return True
    return False
