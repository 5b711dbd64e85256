"""Qwen's documented vLLM offline example, run on pagedllm: the import differs, and MODEL is a
local path from pagedllm.model_path (there is no Hub here)."""

import os
import sys

from transformers import AutoTokenizer

from pagedllm import LLM, SamplingParams, model_path

if __name__ == "__main__":
    # Default: the default model, fetched once into the cache; override with argv[1] or $PAGEDLLM_MODEL.
    override = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("PAGEDLLM_MODEL")
    MODEL = model_path(override) if override else model_path()

    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    sampling_params = SamplingParams(temperature=0.7, top_p=0.8, repetition_penalty=1.05, max_tokens=512)
    llm = LLM(model=MODEL)

    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Tell me something about large language models."},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    outputs = llm.generate([text], sampling_params)
    for output in outputs:
        print(f"Prompt: {output.prompt!r}, Generated text: {output.outputs[0].text!r}")
