"""``hf-accel bench-step``: one decode step, split into matrix products and everything else.

A decode step of a small model on a CPU is bound by reading weights. This measures, side by side in one
process, the wall time of a step at a given context length, the share spent in matrix-product kernels
(from the profiler), and the weight bytes those kernels read per second next to what ``x.sum()`` reads
from memory on this machine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from hf_accel.runtime.cached_lm import CachedLM

#: Profiler names of the kernels that multiply by a weight matrix (fp32, prepacked, int8, int4).
MATMUL_KERNELS = frozenset({"aten::mm", "aten::addmm", "mkldnn::_linear_pointwise", "aten::_weight_int8pack_mm",
                            "aten::_weight_int4pack_mm_for_cpu", "quantized::linear_dynamic"})


@dataclass
class StepProfile:
    config: str
    step_ms: float
    matmul_ms: float
    weight_mb: float
    compile_s: float | None = None  # the patch's compiled step: seconds spent compiling, if it has one

    @property
    def tokens_per_s(self) -> float:
        return 1000 / self.step_ms if self.step_ms > 0 else float("inf")

    @property
    def other_ms(self) -> float:
        return max(self.step_ms - self.matmul_ms, 0.0)

    @property
    def matmul_gb_s(self) -> float:
        return self.weight_mb * 2**20 / 1e9 / (self.matmul_ms / 1000) if self.matmul_ms else float("nan")


def matmul_weight_bytes(model: nn.Module) -> int:
    """Bytes of every 2-D weight (or quantized ``qweight`` / ``packed_weight``) a step multiplies by: all leaf
    modules with one, except embedding tables, which are indexed rather than read whole. Tied tensors once. A
    layer whose plain weight was freed for a packed copy says what it reads through ``packed_bytes()``."""
    seen, total = set(), 0
    for module in model.modules():
        if next(module.children(), None) is not None or isinstance(module, nn.Embedding):
            continue
        for name in ("packed_weight", "qweight", "weight"):
            tensor = getattr(module, name, None)
            if isinstance(tensor, torch.Tensor) and tensor.dim() == 2:
                if tensor.data_ptr() not in seen:
                    seen.add(tensor.data_ptr())
                    total += tensor.numel() * tensor.element_size()
                break
        else:
            total += module.packed_bytes() if callable(getattr(module, "packed_bytes", None)) else 0
    return total


def memory_read_gb_s(gib: int = 1) -> float:
    """What ``x.sum()`` reads per second over ``gib`` GiB of fp32: the machine's practical bandwidth."""
    x = torch.ones(gib * 2**28)
    x.sum()
    start = time.perf_counter()
    for _ in range(3):
        x.sum()
    return 3 * gib * 2**30 / 1e9 / (time.perf_counter() - start)


def matmul_ms(prof: torch.profiler.profile) -> float:
    """Milliseconds the profiled run spent in weight-product kernels (their self time)."""
    return sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in MATMUL_KERNELS) / 1000


def profile_step(model: nn.Module, config: str, context: int = 300, chunk: int = 1, steps: int = 8) -> StepProfile:
    """Median wall time of a ``chunk``-token step after a ``context``-token prompt, and its matmul time."""
    vocab = model.config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(0)
    lm = CachedLM(model)
    with torch.no_grad():
        prompt = torch.randint(0, vocab, (1, context), generator=generator)
        lm.prefill(prompt, torch.ones_like(prompt))

        def step() -> None:
            lm.extend(torch.randint(0, vocab, (1, chunk), generator=generator))
            lm.keep(torch.tensor([1]))

        step()
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                step()
    return StepProfile(config, 1000 * sorted(times)[len(times) // 2], matmul_ms(prof) / steps,
                       matmul_weight_bytes(model) / 2**20)


def profile_generate_step(model: nn.Module, config: str, context: int = 300, steps: int = 32) -> StepProfile:
    """The same, for a decode step inside ``generate`` (so through a patch's compiled step, if any): the
    difference between generating ``steps + 1`` tokens and one token, divided by ``steps``."""
    vocab = model.config.get_text_config().vocab_size
    prompt = torch.randint(0, vocab, (1, context), generator=torch.Generator().manual_seed(0))

    def run(new_tokens: int) -> None:
        model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                       max_new_tokens=new_tokens, min_new_tokens=new_tokens)

    run(steps + 1)  # warm up (and compile)
    seconds, matmul = {}, {}
    for n in (1, steps + 1):
        start = time.perf_counter()
        run(n)
        seconds[n] = time.perf_counter() - start
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            run(n)
        matmul[n] = matmul_ms(prof)
    return StepProfile(config, 1000 * (seconds[steps + 1] - seconds[1]) / steps,
                       (matmul[steps + 1] - matmul[1]) / steps, matmul_weight_bytes(model) / 2**20)


def format_step_table(rows: list[StepProfile], bandwidth: float) -> str:
    """One row per configuration; "vs stock" divides by the first row's step time."""
    lines = ["| config | step ms | decode tok/s | vs stock | compile s | matmul ms | everything else ms | weights MB "
             "| matmul reads GB/s | vs memory |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        compile_s = "-" if r.compile_s is None else f"{r.compile_s:.1f}"
        lines.append(f"| {r.config} | {r.step_ms:.1f} | {r.tokens_per_s:.1f} | {rows[0].step_ms / r.step_ms:.2f}x | "
                     f"{compile_s} | {r.matmul_ms:.1f} | {r.other_ms:.1f} | {r.weight_mb:.0f} | "
                     f"{r.matmul_gb_s:.1f} | {r.matmul_gb_s / bandwidth:.0%} |")
    return "\n".join(lines) + f"\n\nmemory read bandwidth (x.sum() over 1 GiB): {bandwidth:.1f} GB/s"
