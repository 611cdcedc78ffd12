"""Which ``GenerationConfig`` settings the speculative loop reproduces, which do not change tokens, and which
send a call to stock ``generate``.

The loop builds its logits processors and stopping criteria with ``generate``'s own builders and applies them
at every verified position with that position's prefix, so every processor that is a function of the prefix
is covered, for greedy and sampling alike. What remains for stock ``generate``: other decoding strategies
(beams, contrastive, DoLa, constraints), settings whose processor keeps state across steps (guidance,
watermarking), and outputs the loop does not compute.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

from transformers import GenerationConfig

COVERED = "covered"
NO_EFFECT = "no effect on tokens"
FALLBACK = "stock generate"

#: Every ``GenerationConfig`` field (transformers 5.23-5.25; a test checks the installed version's): how the
#: loop treats a non-default value, and why.
SETTINGS: dict[str, tuple[str, str]] = {
    # lengths and stopping
    "max_length": (COVERED, "length limit"),
    "max_new_tokens": (COVERED, "length limit"),
    "min_length": (COVERED, "processor, applied per position"),
    "min_new_tokens": (COVERED, "processor, applied per position"),
    "eos_token_id": (COVERED, "stops the row"),
    "stop_strings": (COVERED, "stopping criterion (pass tokenizer= to generate, as stock requires); batch > 1 "
                              "without an eos_token_id runs stock, which keeps generating rows that stopped"),
    "max_time": (COVERED, "asked once per step for the whole batch: when the time is up every row ends at the "
                          "shortest running row's length, where stock's would all have ended at that step"),
    "early_stopping": (NO_EFFECT, "beam search only"),
    # sampling
    "do_sample": (COVERED, "exact speculative sampling"),
    "temperature": (COVERED, "warper"),
    "top_k": (COVERED, "warper"),
    "top_p": (COVERED, "warper"),
    "min_p": (COVERED, "warper"),
    "typical_p": (COVERED, "warper"),
    "epsilon_cutoff": (COVERED, "warper"),
    "eta_cutoff": (COVERED, "warper"),
    "top_h": (COVERED, "warper"),
    # logits processors
    "repetition_penalty": (COVERED, "processor, applied per position"),
    "encoder_repetition_penalty": (COVERED, "processor over the prompt, applied per position"),
    "no_repeat_ngram_size": (COVERED, "processor, applied per position"),
    "encoder_no_repeat_ngram_size": (COVERED, "processor over the prompt, applied per position"),
    "bad_words_ids": (COVERED, "processor, applied per position"),
    "sequence_bias": (COVERED, "processor, applied per position"),
    "suppress_tokens": (COVERED, "processor"),
    "begin_suppress_tokens": (COVERED, "processor"),
    "forced_bos_token_id": (COVERED, "processor"),
    "forced_eos_token_id": (COVERED, "processor"),
    "exponential_decay_length_penalty": (COVERED, "processor, applied per position"),
    "remove_invalid_values": (COVERED, "processor"),
    "renormalize_logits": (COVERED, "processor"),
    "length_penalty": (NO_EFFECT, "beam search only"),
    # outputs
    "num_return_sequences": (COVERED, "rows expanded as stock expands them (sampling)"),
    "output_scores": (COVERED, "batch 1; batch > 1 runs stock, which scores rows after they end"),
    "output_logits": (COVERED, "batch 1; batch > 1 runs stock, which scores rows after they end"),
    "return_dict_in_generate": (COVERED, "a GenerateDecoderOnlyOutput"),
    "output_attentions": (FALLBACK, "the loop does not collect attention weights"),
    "output_hidden_states": (FALLBACK, "the loop does not collect hidden states"),
    # special tokens
    "pad_token_id": (COVERED, "pads finished rows"),
    "bos_token_id": (NO_EFFECT, "used only without input ids"),
    "decoder_start_token_id": (NO_EFFECT, "encoder-decoder models only"),
    # other decoding strategies
    "num_beams": (FALLBACK, "beam search"),
    "num_beam_groups": (FALLBACK, "group beam search"),
    "diversity_penalty": (FALLBACK, "group beam search"),
    "penalty_alpha": (FALLBACK, "contrastive search"),
    "dola_layers": (FALLBACK, "DoLa decoding"),
    "constraints": (FALLBACK, "constrained beam search"),
    "force_words_ids": (FALLBACK, "constrained beam search"),
    "low_memory": (NO_EFFECT, "beam and contrastive search only"),
    "guidance_scale": (FALLBACK, "classifier-free guidance runs a second, unconditional pass with its own state"),
    "watermarking_config": (FALLBACK, "SynthID's processor keeps state across steps; a WatermarkingConfig's is a "
                                      "function of the prefix, but each per-row copy builds an 8 MB table"),
    "token_healing": (FALLBACK, "rewrites the prompt"),
    # transformers' own assisted / speculative decoding
    "prompt_lookup_num_tokens": (FALLBACK, "transformers' own prompt-lookup decoding was asked for"),
    "max_matching_ngram_size": (NO_EFFECT, "prompt-lookup decoding only"),
    "num_assistant_tokens": (NO_EFFECT, "assisted decoding only"),
    "num_assistant_tokens_schedule": (NO_EFFECT, "assisted decoding only"),
    "assistant_confidence_threshold": (NO_EFFECT, "assisted decoding only"),
    "assistant_lookbehind": (NO_EFFECT, "assisted decoding only"),
    "target_lookbehind": (NO_EFFECT, "assisted decoding only"),
    "assistant_early_exit": (FALLBACK, "transformers' self-speculative early exit was asked for"),
    "assistant_ensemble_weight": (FALLBACK, "transformers' assisted decoding was asked for"),
    "is_assistant": (FALLBACK, "the model is used as an assistant"),
    "speculation_type": (FALLBACK, "transformers' own speculation was asked for"),
    "use_mtp": (FALLBACK, "multi-token prediction heads"),
    # caches and compilation
    "use_cache": (NO_EFFECT, "whether stock caches or recomputes; the loop always caches"),
    "cache_implementation": (FALLBACK, "a cache implementation of the call's own"),
    "cache_config": (FALLBACK, "a cache configuration of the call's own"),
    "max_cache_len": (FALLBACK, "a cache size of the call's own"),
    "prefill_chunk_size": (FALLBACK, "chunked prefill"),
    "compile_config": (NO_EFFECT, "compilation settings"),
    "disable_compile": (NO_EFFECT, "turns off the compiled step, not speculation"),
    "continuous_batching_config": (NO_EFFECT, "continuous batching only"),
    # bookkeeping
    "transformers_version": (NO_EFFECT, "metadata"),
    "_from_model_config": (NO_EFFECT, "metadata"),
}


#: Values that turn a fallback setting off without being its default (stock checks these, not the default;
#: ``generate`` drops ``cache_implementation="hybrid"``, which older model cards carry, before using it).
NEUTRAL: dict[str, object] = {"guidance_scale": 1.0, "penalty_alpha": 0.0, "num_beams": 1, "num_beam_groups": 1,
                              "cache_implementation": "hybrid"}


class BlockingSetting(NamedTuple):
    """A setting that sends calls to stock ``generate``: its name, its value and why (``str``: ``key=value (why)``)."""

    key: str
    value: Any
    why: str

    def __str__(self) -> str:
        return f"{self.key}={self.value!r} ({self.why})"


def blocking_settings(config: GenerationConfig) -> list[BlockingSetting]:
    """The non-default settings of ``config`` that send a call to stock ``generate``, each with the reason."""
    defaults = config._get_default_generation_params()
    fields = known_fields()
    found = []
    for key, value in config.to_dict().items():
        default = defaults.get(key)
        if value is None or value == default or (value is False and default in (None, False)):
            continue  # None: not set, the default applies
        if NEUTRAL.get(key) == value:
            continue
        unknown = (FALLBACK, "a setting this version of hf_accel does not know") if key in fields else (
            NO_EFFECT, "not a transformers setting")  # a model card's own entry: generate ignores it
        status, why = SETTINGS.get(key, unknown)
        if status == FALLBACK:
            found.append(BlockingSetting(key, value, why))
    return found


def returns_scores(config: GenerationConfig) -> bool:
    """Whether calls return per-step scores or logits: stock keeps scoring rows that ended, on padding, until
    the last row ends, which the loop does not (it stops running them), so batches of them run stock."""
    return bool(config.return_dict_in_generate and (config.output_scores or config.output_logits))


def stops_without_eos(config: GenerationConfig) -> bool:
    """Whether a stop string may end a row while there is no EOS token to pad it with: stock then keeps
    generating real tokens for it until every row has ended, which the loop would not, so batches of them run
    stock. (The clock ends every row at once, in stock and in the loop.)"""
    return config.eos_token_id in (None, []) and bool(config.stop_strings)


def batch_blocking_settings(config: GenerationConfig) -> list[str]:
    """The settings of ``config`` that send calls with more than one row (only those) to stock ``generate``,
    each with the reason (see ``plan_call``)."""
    found = [f"{key}=True with return_dict_in_generate (stock keeps scoring rows that ended until the last "
             "one ends)" for key in ("output_scores", "output_logits")
             if returns_scores(config) and getattr(config, key, False)]
    if stops_without_eos(config):
        found.append(f"stop_strings={config.stop_strings!r} without an eos_token_id (stock keeps generating rows "
                     "that stopped, unpadded)")
    return found


def settings_table() -> str:
    """The Markdown table of every setting and how the loop treats it (docs/features.md holds a copy)."""
    lines = ["| setting | with speculation | why |", "| --- | --- | --- |"]
    for key in sorted(SETTINGS, key=lambda k: k.lstrip("_")):
        status, why = SETTINGS[key]
        lines.append(f"| `{key}` | {status} | {why} |")
    return "\n".join(lines)


@functools.cache
def known_fields() -> frozenset[str]:
    """The fields of this transformers version's ``GenerationConfig``."""
    return frozenset(GenerationConfig().to_dict())
