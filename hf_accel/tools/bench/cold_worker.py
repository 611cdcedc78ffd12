"""One run of ``hf-accel bench --cold``: the short script a user would write, in a process of its own.

Run as a file, not a module (``python cold_worker.py SPEC``), so that a stock run imports nothing of
hf_accel: it loads the model, optionally patches it with one line, generates once from a chat prompt,
and prints its timings as one JSON line. ``SPEC`` is a JSON object: ``model_dir``, ``gguf_file``, ``prompt``,
``max_new_tokens``, and ``patch`` (``null`` for stock, else the ``patch()`` keyword arguments).

With ``"calls"`` in ``SPEC`` (a list of ``[max_new_tokens, [prompt, ...]]``, one prompt per row) it is a
long-running process instead: the calls one after another on the stock model, then the same calls after
``patch``, each timed, side by side. With ``"memory": true`` as well, the model runs the calls once, stock or
patched (``patch``): the process's peak resident memory while loading, then (the peak counter reset) the
peak since loading, read after patching, after the first call and after the last (``hf-accel bench
--memory``).
"""

import time

START = time.perf_counter()

import json  # noqa: E402
import sys  # noqa: E402


def main(spec: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    imported = time.perf_counter()
    kwargs = {"gguf_file": spec["gguf_file"]} if spec.get("gguf_file") else {}
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"], **kwargs)
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32, **kwargs).eval()
    loaded = time.perf_counter()
    if spec["patch"] is not None:
        import hf_accel

        model = hf_accel.patch(model, **spec["patch"])
    patched = time.perf_counter()
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": spec["prompt"]}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    first = []

    class FirstToken:
        def put(self, value):
            if len(first) < 2:
                first.append(time.perf_counter())

        def end(self):
            pass

    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=spec["max_new_tokens"], do_sample=False, streamer=FirstToken(),
                             pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    done = time.perf_counter()
    return {"import_s": imported - START, "load_s": loaded - imported, "patch_s": patched - loaded,
            "generate_s": done - start, "ttft_s": (first[1] if len(first) > 1 else done) - start,
            "tokens": int(out.shape[-1] - inputs["input_ids"].shape[-1]), "in_process_s": done - START,
            "token_ids": out[0, inputs["input_ids"].shape[-1]:].tolist()}


def _resident_mb(field: str) -> float:
    """``VmHWM`` (peak since start) or ``VmRSS`` (now) of this process, in MiB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _load_for_calls(spec: dict):
    """The tokenizer (left padding, for batches), the model, and the pad token id."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"gguf_file": spec["gguf_file"]} if spec.get("gguf_file") else {}
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"], **kwargs)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32, **kwargs).eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return tokenizer, model, pad


def _encode_batch(tokenizer, prompts: list) -> dict:
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                           tokenize=False) for p in prompts]
    return tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)


def memory(spec: dict) -> dict:
    import torch

    tokenizer, model, pad = _load_for_calls(spec)
    peaks = {"load_mb": _resident_mb("VmHWM"), "resident_after_load_mb": _resident_mb("VmRSS")}
    # Loading may peak above what the model keeps (a GGUF file is dequantized): from here on, peaks since.
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    held = None
    if spec["patch"] is not None:
        import hf_accel

        model = hf_accel.patch(model, **spec["patch"])
    peaks["patch_mb"] = _resident_mb("VmHWM")
    for i, (max_new_tokens, prompts) in enumerate(spec["calls"]):
        inputs = _encode_batch(tokenizer, prompts)
        with torch.no_grad():
            model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
        if i == 0:
            peaks["first_call_mb"] = _resident_mb("VmHWM")
    if spec["patch"] is not None:
        held = hf_accel.report(model).memory_bytes
    return {**peaks, "last_call_mb": _resident_mb("VmHWM"), "report_held_bytes": held}


def calls(spec: dict) -> dict:
    import torch

    tokenizer, model, pad = _load_for_calls(spec)
    encoded = [(max_new_tokens, _encode_batch(tokenizer, prompts)) for max_new_tokens, prompts in spec["calls"]]

    def run_all(compiled_seconds=lambda: 0.0) -> list[dict]:
        results = []
        for max_new_tokens, inputs in encoded:
            compiled_before, start = compiled_seconds(), time.perf_counter()
            with torch.no_grad():
                out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
            results.append({"seconds": time.perf_counter() - start, "batch": int(inputs["input_ids"].shape[0]),
                            "prompt_tokens": int(inputs["input_ids"].shape[1]), "max_new_tokens": max_new_tokens,
                            "compile_s": compiled_seconds() - compiled_before,
                            "token_ids": out[:, inputs["input_ids"].shape[1]:].tolist()})
        return results

    stock = run_all()
    import hf_accel

    def compiled_seconds() -> float:
        """Seconds this model's compiled steps (the target's, a draft's) have spent compiling."""
        report = hf_accel.report(model)
        steps = [report["compile"].details, *report["speculative"].details.get("compiled", {}).values()]
        return sum(step.get("compile_seconds", 0.0) for step in steps)

    start = time.perf_counter()
    model = hf_accel.patch(model, **spec["patch"])
    patch_s = time.perf_counter() - start
    return {"stock": stock, "patched": run_all(compiled_seconds), "patch_s": patch_s}


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    result = memory(spec) if spec.get("memory") else calls(spec) if "calls" in spec else main(spec)
    print("HF_ACCEL_COLD_RESULT " + json.dumps(result), flush=True)
