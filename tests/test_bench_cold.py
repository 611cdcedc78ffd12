"""``hf-accel bench --cold``: the break-even fit, identity to stock, the tables, bad arguments, and one real
fresh-process run (of a tiny model: SmolLM2's, memory included, is ``--memory``'s test in the slow group)."""

from __future__ import annotations

import math

import pytest

from hf_accel.tools import cli
from hf_accel.tools.bench import cold as bench_cold
from hf_accel.tools.bench.cold import ColdRun, break_even, format_break_even, format_cold_table


def runs(config: str, fixed: float, per_token: float, caches: str = "cold", lengths=(32, 128, 512),
         tokens=None) -> list[ColdRun]:
    """Runs whose processes take ``fixed`` seconds besides ``per_token`` seconds per generated token."""
    made = tokens or {n: n for n in lengths}
    return [ColdRun(caches, config, n, made[n], total_s=fixed + per_token * made[n], import_s=2.0, load_s=15.0,
                    patch_s=0.0 if config == "stock" else 2.5, generate_s=0.4 + per_token * made[n], ttft_s=0.1,
                    token_ids=list(range(made[n])))
            for n in lengths]


def test_break_even_is_where_the_fixed_cost_is_paid_back_by_faster_tokens():
    rows = runs("stock", 20.0, 0.06) + runs("patch(model)", 23.0, 0.02)
    assert break_even(rows, "patch(model)", "cold") == pytest.approx(75.0)  # 3 s / 0.04 s per token


def test_break_even_counts_tokens_made_not_asked_for():
    made = {32: 32, 128: 128, 512: 300}  # the answer ended at EOS after 300 tokens
    rows = runs("stock", 20.0, 0.06, tokens=made) + runs("patch(model)", 23.0, 0.02, tokens=made)
    assert break_even(rows, "patch(model)", "cold") == pytest.approx(75.0)


def test_break_even_from_the_first_token_never_or_unknown():
    stock = runs("stock", 20.0, 0.06)
    assert break_even(stock + runs("a", 19.0, 0.03), "a", "cold") == 0.0
    assert math.isinf(break_even(stock + runs("b", 21.0, 0.07), "b", "cold"))
    assert break_even(stock + runs("c", 21.0, 0.01, lengths=(128,)), "c", "cold") is None  # one length: no fit
    table = format_break_even(stock + runs("a", 19.0, 0.03) + runs("b", 21.0, 0.07))
    assert "| cold   | a      | from the first token" in table and "| cold   | b      | never" in table


def test_runs_are_compared_with_stock_tokens_of_the_same_caches_and_length():
    rows = runs("stock", 20.0, 0.06) + runs("patch(model)", 23.0, 0.02)
    rows[-1].token_ids = [7]  # the 512-token patched run made other tokens
    bench_cold._mark_identity(rows)
    assert [r.identical for r in rows] == [None, None, None, True, True, False]
    table = format_cold_table(rows)
    assert "| cold   | patch(model) | 512     | 512    | 33.2    | 0.66x    |" in table and "NO" in table


@pytest.mark.parametrize("lengths, message", [("128", "at least two lengths"), ("32,lots", "comma-separated"),
                                              ("0,32", "at least 1")])
def test_bad_lengths_are_refused_before_any_process_starts(lengths, message, capsys):
    assert cli.main(["bench", "--cold", "--lengths", lengths]) == 2
    assert message in capsys.readouterr().err


def test_calls_in_one_process_are_set_against_stocks_same_call():
    pairs = [bench_cold.CallPair("warm", 3, 3, 40, 48, stock_s=6.0, patched_s=2.5, identical=True),
             bench_cold.CallPair("cold", 5, 2, 60, 200, stock_s=14.0, patched_s=15.5, identical=False, compile_s=9.0)]
    table = bench_cold.format_calls_table(pairs)
    assert "| warm   | 3    | 3     | 40            | 48      | 6.0     | 2.5       | 0.0" in table
    assert "| 9.0                  | +1.5              | NO        |" in table


def test_the_memory_table_sets_each_peak_against_stocks_and_the_first_call():
    from hf_accel.tools.bench.memory import MemoryRun, format_memory_table

    table = format_memory_table([MemoryRun("stock", 1200.0, 990.0, 990.0, 1010.0, 1050.0, None),
                                 MemoryRun("patch(model)", 1200.0, 990.0, 1140.0, 1200.0, 1260.0, 230 * 2**20)],
                                calls=20)
    rows = {cells[0]: cells for line in table.splitlines()
            if (cells := [cell.strip() for cell in line.strip().strip("|").split("|")])}
    assert "load peak MiB" in rows["config"]
    assert rows["stock"][:5] == ["stock", "1200", "990", "1010", "1050"]
    assert rows["patch(model)"][4:] == ["1260", "1.20x", "1.05x", "1260", "1.05x", "+230"]


def test_a_fresh_process_runs_the_users_script_patched_and_times_it_from_the_inside(tiny_model_dir):
    spec = {"model_dir": str(tiny_model_dir), "gguf_file": None, "prompt": "w1 w2 w3 w1 w2", "max_new_tokens": 6,
            "patch": {}}
    result = bench_cold.run_worker(spec, {})
    assert result["tokens"] == len(result["token_ids"]) and 1 <= result["tokens"] <= 6
    assert result["patch_s"] > 0 and 0 < result["ttft_s"] <= result["generate_s"] < result["in_process_s"]
