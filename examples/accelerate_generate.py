"""Data-parallel batched generation with accelerate; hf_accel is the one marked line.

Each process takes its shard of a JSONL prompt file, generates in batches, and the main process writes every
result, in the file's order, to ``--out``, and each process's tokens/s and speculative statistics (its own
calls', not the patch's probes') to ``OUT.stats.json``::

    accelerate launch --num_processes 2 examples/accelerate_generate.py --prompts prompts.jsonl --out results.jsonl
    torchrun --nproc_per_node 2 examples/accelerate_generate.py --tiny --out results.jsonl   # 2 CPU processes
    python examples/accelerate_generate.py --stock --out stock.jsonl          # one process, no patch

On a machine without an accelerator the processes talk over gloo: launch them with ``torchrun`` (or
``accelerate launch --multi_gpu``, which calls it); ``accelerate launch --cpu`` starts more than one process
only through ``mpirun``.

A prompt file has one ``{"prompt": ...}`` per line (``category`` and ``name`` optional); without one, the
prompts shipped with hf_accel. ``--tiny`` swaps the embedded SmolLM2 for a small random Llama with its
tokenizer (for tests). Nothing here assumes one machine: ``accelerate launch --num_machines`` runs it as is.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from accelerate import PartialState
from accelerate.utils import gather_object, parse_flag_from_env
from tqdm.auto import tqdm
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

import hf_accel
from hf_accel.tools.models import default_model_file, load_default_model
from hf_accel.tools.prompts import load_prompts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", help="JSONL prompt file (default: the prompts shipped with hf_accel)")
    parser.add_argument("--out", required=True, help="where the main process writes the results (JSONL)")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--tiny", action="store_true", help="a small random Llama instead of the embedded model")
    parser.add_argument("--stock", action="store_true", help="run without hf_accel (the baseline)")
    args = parser.parse_args(argv)
    if args.batch_size < 1 or args.max_new_tokens < 1:
        parser.error("--batch-size and --max-new-tokens must be at least 1")
    return args


def load(tiny: bool, device: torch.device):
    """The model and its tokenizer, the same on every process (a seeded random model with ``tiny``)."""
    if not tiny:
        model, tokenizer = load_default_model(device=device)
    else:
        gguf = default_model_file()
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                             bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id)
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).to(device).eval()
    tokenizer.padding_side = "left"  # decoder-only batches pad on the left
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def _as_list(ids: int | list[int] | None) -> list[int]:
    return [] if ids is None else [ids] if isinstance(ids, int) else list(ids)


def until_end_of_sequence(ids: list[int], end: set[int]) -> list[int]:
    """A row's new tokens up to and including its first end-of-sequence token: what follows is the padding
    of rows that finished before the batch did (a pad token inside an answer is kept)."""
    for position, token in enumerate(ids):
        if token in end:
            return ids[:position + 1]
    return ids


def speculative_counts(model) -> dict[str, int]:
    """Draft tokens proposed and accepted so far by a patched model (its patch's own probes included)."""
    details = hf_accel.report(model)["speculative"].details
    return {key: int(details.get(key) or 0) for key in ("drafted", "accepted")}


def generate_shard(model, tokenizer, shard: list, batch_size: int, max_new_tokens: int, show: bool) -> list[dict]:
    """Greedy completions of ``shard`` (``(index, Prompt)`` pairs), in batches."""
    end = set(_as_list(model.generation_config.eos_token_id))
    results = []
    for start in tqdm(range(0, len(shard), batch_size), desc="generate", disable=not show):
        batch = shard[start:start + batch_size]
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": p.prompt}], tokenize=False,
                                               add_generation_prompt=True) for _, p in batch]
        # The template already holds the special tokens; the tokenizer must not add a second BOS.
        inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
        output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        for (index, prompt), row in zip(batch, output[:, inputs["input_ids"].shape[1]:]):
            ids = until_end_of_sequence(row.tolist(), end)
            results.append({"index": index, "category": prompt.category, "name": prompt.name,
                            "completion": tokenizer.decode(ids, skip_special_tokens=True), "new_token_ids": ids})
    return results


def has_accelerator() -> bool:
    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6; CUDA alone before
    return accelerator.is_available() if accelerator is not None else torch.cuda.is_available()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    prompts = list(enumerate(load_prompts(args.prompts)))  # a bad file stops the job before any model loads
    # Without an accelerator (or with `accelerate launch --cpu`) the processes run on the CPU over gloo.
    state = PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU") or not has_accelerator())
    model, tokenizer = load(args.tiny, state.device)
    if not args.stock:
        model = hf_accel.patch(model)  # <- the one line
    before = None if args.stock else speculative_counts(model)  # the patch's probes speculated already
    with state.split_between_processes(prompts) as shard:
        start = time.perf_counter()
        results = generate_shard(model, tokenizer, shard, args.batch_size, args.max_new_tokens,
                                 show=state.is_main_process)
        seconds = time.perf_counter() - start
    tokens = sum(len(r["new_token_ids"]) for r in results)
    if before is None:
        speculative = {"drafted": None, "accepted": None}
    else:
        speculative = {key: count - before[key] for key, count in speculative_counts(model).items()}
    stats = {"rank": state.process_index, "prompts": len(results), "new_tokens": tokens,
             "generate_s": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 2) if seconds > 0 else None,
             **speculative}
    every_result, every_stats = gather_object(results), gather_object([stats])
    if state.is_main_process:
        out = Path(args.out)
        with out.open("w") as f:
            for result in sorted(every_result, key=lambda r: r["index"]):
                f.write(json.dumps(result) + "\n")
        stats_file = out.with_name(out.name + ".stats.json")
        stats_file.write_text(json.dumps({"processes": state.num_processes, "ranks": every_stats}, indent=1))
        for s in every_stats:
            print(json.dumps(s))
        print(f"{len(every_result)} results written to {out}, each process's statistics to {stats_file}")
    state.wait_for_everyone()
    state.destroy_process_group()


if __name__ == "__main__":
    main()
