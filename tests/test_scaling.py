"""Patched models in multi-process jobs (accelerate, torchrun, tensor parallelism) and offloaded models."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from conftest import left_padded_batch, make_tiny_model

import hf_accel

pytest.importorskip("accelerate")

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "accelerate_generate.py"
WORKER = Path(__file__).resolve().parent / "distributed_worker.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(launcher: list[str], out: Path, *flags: str, cache: Path) -> list[dict]:
    """Run the example; the ranks' statistics it prints, one JSON object a line."""
    env = {**os.environ, "HF_ACCEL_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([*launcher, str(SCRIPT), "--tiny", "--max-new-tokens", "16", "--out", str(out), *flags],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"rank"')]


def test_two_processes_gather_in_order_what_one_stock_process_makes(tmp_path):
    """Two CPU processes (gloo) each patch the model and take half of the 8 shipped prompts in batches of 2;
    the main process writes every result in the file's order, token for token a single stock run's."""
    stock = run_job([sys.executable], tmp_path / "stock.jsonl", "--stock", cache=tmp_path / "cache")
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
              "--main_process_port", str(free_port())]
    ranks = run_job(launch, tmp_path / "patched.jsonl", cache=tmp_path / "cache")
    expected = [json.loads(line) for line in (tmp_path / "stock.jsonl").read_text().splitlines()]
    gathered = [json.loads(line) for line in (tmp_path / "patched.jsonl").read_text().splitlines()]
    assert [r["index"] for r in gathered] == list(range(8))
    assert [r["new_token_ids"] for r in gathered] == [r["new_token_ids"] for r in expected]
    assert all(len(r["new_token_ids"]) == 16 for r in expected)
    assert [(r["rank"], r["prompts"]) for r in stock] == [(0, 8)]
    assert sorted((r["rank"], r["prompts"]) for r in ranks) == [(0, 4), (1, 4)]
    assert all(r["accepted"] > 0 for r in ranks)  # each process's patched model speculated


def torchrun(*args: str, cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_ACCEL_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("setup", ["ddp", "unwrap", "tp"])
def test_a_model_patched_in_each_process_of_a_distributed_job_is_stock_token_for_token(setup, tmp_path):
    """Two processes over gloo: a model accelerate wrapped in DistributedDataParallel (patched through the
    wrapper), the model ``unwrap_model`` gives back, and a model loaded with ``tp_plan="auto"`` (weights
    sharded as DTensors: what needs whole weights is skipped with the reason, the rest applies)."""
    model_dir = tmp_path / "tiny"
    if setup == "tp":
        make_tiny_model("llama").save_pretrained(model_dir)
    out = tmp_path / "ranks.json"
    done = torchrun(str(WORKER), setup, str(out), str(model_dir), cache=tmp_path / "cache")
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = json.loads(out.read_text())
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["world"] == 2 for r in ranks)
    for rank in ranks:
        assert "error" not in rank, rank.get("traceback")
        assert rank["identical"] and rank["accepted"] > 0
        if setup == "ddp":
            assert rank["wrapper"] == "DistributedDataParallel"
        if setup == "tp":
            assert rank["backends"]["compile"] is None and rank["backends"]["speculative"] == "ngram"
            assert rank["backends"]["kv_cache"] == "static"
            assert "sharded across processes (tp_plan)" in rank["skipped"]["inductor"]
        else:
            assert rank["backends"]["compile"] == "inductor"


def test_a_model_with_a_layer_offloaded_to_disk_gets_what_serves_it_and_stock_tokens(tmp_path):
    """accelerate's hooks load the offloaded layer's weights as it runs (its parameters are meta in between):
    what needs whole weights is skipped with the reason and what to do; the rest applies, token-identical."""
    make_tiny_model("llama").save_pretrained(tmp_path / "tiny")
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk", "model.norm": "cpu",
                  "model.rotary_emb": "cpu", "lm_head": "cpu"}
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "tiny", device_map=device_map,
                                                              offload_folder=tmp_path / "offload").eval()
    ids, mask = left_padded_batch(model)
    generate = lambda: model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    expected = generate()
    hf_accel.patch(model)
    assert torch.equal(generate(), expected)
    report = hf_accel.report(model)
    assert report["compile"].backend is None and report["kv_cache"].backend == "static"
    assert report["speculative"].backend == "ngram" and report["speculative"].details["accepted"] > 0
    skipped = {s["backend"]: s["reason"] for s in report["compile"].skipped}
    assert "offloaded until each layer runs" in skipped["inductor"] and "without offload" in skipped["inductor"]
    hf_accel.unpatch(model)
    assert torch.equal(generate(), expected)
