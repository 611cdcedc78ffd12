"""One run of ``hf-accel bench --cold``: the short script a user would write, in a process of its own.

Run as a file, not a module (``python cold_worker.py SPEC``), so that a stock run imports nothing of
hf_accel: it loads the model, optionally patches it with one line, generates once from a chat prompt,
and prints its timings as one JSON line. ``SPEC`` is a JSON object: ``model_dir``, ``gguf_file``, ``prompt``,
``max_new_tokens``, and ``patch`` (``null`` for stock, else the ``patch()`` keyword arguments).
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


if __name__ == "__main__":
    print("HF_ACCEL_COLD_RESULT " + json.dumps(main(json.loads(sys.argv[1]))), flush=True)
