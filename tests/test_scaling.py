"""Patched models in multi-process jobs (accelerate, torchrun, tensor parallelism) and offloaded models."""

from __future__ import annotations

import json
import os
import signal
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


def run_processes(command: list[str], cache: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run a launcher and the processes it starts, on the CPU even where a GPU is present; past ``timeout``
    the whole process group is killed, so no worker outlives the test waiting on a dead peer."""
    env = {**os.environ, "HF_ACCEL_CACHE": str(cache), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    with subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            stdout, stderr = process.communicate()
            pytest.fail(f"{command[:4]} ran past {timeout} s; the last of its output:\n{stderr[-3000:]}")
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def run_job(launcher: list[str], out: Path, *flags: str, cache: Path) -> list[dict]:
    """Run the example; the ranks' statistics it prints, one JSON object a line."""
    done = run_processes([*launcher, str(SCRIPT), "--tiny", "--max-new-tokens", "16", "--out", str(out), *flags],
                         cache)
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
    assert all(r["accepted"] > 0 for r in ranks)  # each process's patched model speculated in the job itself
    assert all(r["accepted"] is None for r in stock)


def torchrun(*args: str, cache: Path) -> subprocess.CompletedProcess:
    # --standalone: the processes meet on a port the launcher picks itself.
    return run_processes([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          *args], cache)


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
        assert rank["identical"] and rank["calls"] == 1 and rank["fallbacks"] == 0 and rank["accepted"] > 0
        if setup == "ddp":
            assert rank["wrapper"] == "DistributedDataParallel"
        if setup == "tp":  # the ranks run one model together: they must choose alike (nothing rank-local decides)
            assert rank["backends"] == ranks[0]["backends"]
            assert rank["backends"]["compile"] is None and rank["backends"]["speculative"] == "ngram"
            assert rank["backends"]["kv_cache"] == "static"
            assert "sharded across processes (tp_plan)" in rank["skipped"]["inductor"]
        else:
            assert rank["backends"]["compile"] == "inductor"


@pytest.mark.parametrize("offloaded", [("model.layers.1",), ("model.embed_tokens", "model.layers.0")],
                         ids=["a-middle-layer", "the-first-weights"])
def test_a_model_with_layers_offloaded_to_disk_gets_what_serves_it_and_stock_tokens(offloaded, tmp_path):
    """accelerate's hooks load an offloaded layer's weights as it runs (its parameters are meta in between):
    what needs whole weights is skipped with the reason and what to do; the rest applies, token-identical. With
    the first weights offloaded the model's own ``device`` says meta; the probes run where the hooks do."""
    make_tiny_model("llama").save_pretrained(tmp_path / "tiny")
    modules = ("model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm", "model.rotary_emb", "lm_head")
    device_map = {name: "disk" if name in offloaded else "cpu" for name in modules}
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "tiny", device_map=device_map,
                                                              offload_folder=tmp_path / "offload").eval()
    ids, mask = left_padded_batch(model)
    generate = lambda: model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    expected = generate()
    hf_accel.patch(model)
    accepted_by_probes = hf_accel.report(model)["speculative"].details["accepted"]
    assert torch.equal(generate(), expected)
    report = hf_accel.report(model)
    assert report.device == "cpu"
    assert report["compile"].backend is None and report["kv_cache"].backend == "static"
    assert report["speculative"].backend == "ngram" and report["speculative"].details["accepted"] > accepted_by_probes
    skipped = {s["backend"]: s["reason"] for s in report["compile"].skipped}
    assert "offloaded until each layer runs" in skipped["inductor"] and "without offload" in skipped["inductor"]
    hf_accel.unpatch(model)
    assert torch.equal(generate(), expected)


def test_bench_processes_launches_the_job_stock_and_patched_and_compares_their_tokens(tmp_path, monkeypatch):
    """``hf-accel bench --processes 2``'s runner on the tiny job: both launches complete, the patched job wrote
    the stock job's tokens and speculated in its own calls, and the table says so."""
    from hf_accel.bench_processes import format_processes_table, run_processes_bench

    monkeypatch.setenv("HF_ACCEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    runs = run_processes_bench(2, ["--tiny", "--max-new-tokens", "8"], tmp_path, timeout=300)
    stock, patched = runs
    assert (stock.config, patched.config) == ("stock", "patch(model)")
    assert len(stock.new_token_ids) == 8 and patched.new_token_ids == stock.new_token_ids
    assert [r["rank"] for r in patched.ranks] == [0, 1] and sum(r["prompts"] for r in patched.ranks) == 8
    assert sum(r["accepted"] for r in patched.ranks) > 0 and all(r["accepted"] is None for r in stock.ranks)
    table = format_processes_table(runs)
    assert "| patch(model) | 2 " in table and "| 8/8 " in table


def test_bench_processes_refuses_what_it_cannot_run(capsys):
    from hf_accel.cli import main

    assert main(["bench", "--processes", "0"]) == 2
    assert main(["bench", "--processes", "2", "--job", "missing.py"]) == 2
    assert main(["bench", "--processes", "2", "--model", "some/dir"]) == 2
    err = capsys.readouterr().err
    assert "--processes, --batch-size" in err and "no job at missing.py" in err and "drop --model" in err
