"""Run under ``torchrun --nproc_per_node 2`` by tests/test_scaling.py: each set-up named, one after the other in
the same job (a launch costs more than the set-ups it runs), greedy output of the patched model against stock on
each process's own batch; rank 0 writes what every rank saw as JSON, ``{setup: [rank 0's, rank 1's]}``.

    torchrun --nproc_per_node 2 tests/distributed_worker.py ddp,unwrap,tp,offload OUT.json [MODEL_DIR]
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from datetime import timedelta

import torch
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs, gather_object
from conftest import left_padded_batch, make_tiny_model
from transformers import AutoModelForCausalLM

import hf_accel
from hf_accel.patching.plugin_manager import reset_plugin_manager


def greedy(model, ids, mask):
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False)


def main(setups: str, out: str, model_dir: str | None = None) -> None:
    # A peer that died leaves the other waiting in a collective: a short timeout turns that into an error.
    accelerator = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=120))])
    results = {}
    for setup in setups.split(","):
        reset_plugin_manager()  # as each test of the suite starts: no set-up sees another's plugin state
        results[setup] = gather_object([run_setup(accelerator, setup, model_dir)])
        if accelerator.is_main_process:  # after each set-up: one that hangs or kills the job loses only itself
            with open(f"{out}.part", "w") as f:
                json.dump(results, f)
            os.replace(f"{out}.part", out)  # whole or not at all, if the job is killed while writing
    accelerator.wait_for_everyone()
    accelerator.state.destroy_process_group()  # left to interpreter exit, gloo's threads can abort the process


def load(setup: str, model_dir: str | None, rank: int):
    if setup == "tp":
        return AutoModelForCausalLM.from_pretrained(model_dir, tp_plan="auto").eval()
    if setup == "offload":  # the first weights and a layer wait on disk until they run
        device_map = {"model.embed_tokens": "disk", "model.layers.0": "cpu", "model.layers.1": "disk",
                      "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
        return AutoModelForCausalLM.from_pretrained(model_dir, device_map=device_map,
                                                    offload_folder=f"{model_dir}/offload-{rank}").eval()
    return make_tiny_model("llama")


def run_setup(accelerator: Accelerator, setup: str, model_dir: str | None) -> dict:
    rank = accelerator.process_index
    result = {"rank": rank, "world": accelerator.num_processes}
    try:
        model = load(setup, model_dir, rank)
        # Data parallel: each process its own batch; tensor parallel: every process the same one.
        ids, mask = left_padded_batch(model, (7, 3, 5), seed=1 if setup == "tp" else rank + 1)
        expected = greedy(model, ids, mask)
        if setup == "ddp":
            wrapped = accelerator.prepare(model)
            result["wrapper"] = type(wrapped).__name__
            hf_accel.patch(wrapped)
            patched = accelerator.unwrap_model(wrapped)
        elif setup == "unwrap":
            patched = accelerator.unwrap_model(accelerator.prepare(model))
            hf_accel.patch(patched)
        else:
            patched = hf_accel.patch(model)
        before = dict(hf_accel.report(model)["speculative"].details)  # the patch's own probes speculated already
        got = greedy(patched, ids, mask)
        report = hf_accel.report(model)
        after = report["speculative"].details
        result.update(identical=bool(torch.equal(got, expected)),
                      backends={name: f.backend for name, f in report.features.items()},
                      calls=after.get("calls", 0) - before.get("calls", 0),
                      accepted=after.get("accepted", 0) - before.get("accepted", 0),
                      fallbacks=after.get("fallbacks_to_stock", 0) - before.get("fallbacks_to_stock", 0),
                      skipped={s["backend"]: s["reason"] for f in report.features.values() for s in f.skipped})
    except Exception as exc:  # noqa: BLE001 - the test reads what went wrong, from every rank
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()[-2000:]
    return result


if __name__ == "__main__":
    main(*sys.argv[1:])
