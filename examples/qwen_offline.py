"""Qwen's documented vLLM offline example, run on pagedllm (only the import differs)."""

import os
import sys

from transformers import AutoTokenizer

from pagedllm import LLM, SamplingParams
from pagedllm.loader.model_store import ensure_model, resolve_model

if __name__ == "__main__":
    # Default: the default model, fetched once into the cache; override with argv[1] or $PAGEDLLM_MODEL.
    override = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("PAGEDLLM_MODEL")
    MODEL = resolve_model(override) if override else str(ensure_model())

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
