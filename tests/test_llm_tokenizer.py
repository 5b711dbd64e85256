"""Starting the engine on a shipped model never imports transformers (~1 s of every start);
LLM.get_tokenizer() still hands out a transformers tokenizer, built on its first call."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# a fresh interpreter: the test process itself has imported transformers long ago
SCRIPT = """
import json, sys
from pagedllm import LLM, SamplingParams
from pagedllm.entrypoints.openai import api_server  # the server's modules too
from pagedllm.sampling_params import StructuredOutputsParams

llm = LLM(model="smollm2-135m-instruct", max_model_len=256, max_num_seqs=2)
greedy = SamplingParams(max_tokens=4, temperature=0)
chat = llm.chat([{"role": "user", "content": "Hi"}], greedy, use_tqdm=False)[0]
choice = SamplingParams(max_tokens=4, temperature=0,
                        structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
picked = llm.generate("Yes or no?", choice, use_tqdm=False)[0].outputs[0].text
engine = llm.llm_engine.tokenizer
after_start = "transformers" in sys.modules
tok = llm.get_tokenizer()
from transformers import PreTrainedTokenizerFast
text = "Hello <|im_start|>world 🤗"
print(json.dumps({
    "after_start": after_start, "engine_type": type(engine).__name__,
    "picked": picked, "chat_ids": chat.prompt_token_ids,
    "hf_is_fast": isinstance(tok, PreTrainedTokenizerFast), "same_object": tok is llm.get_tokenizer(),
    "hf_chat_ids": tok.apply_chat_template([{"role": "user", "content": "Hi"}],
                                           add_generation_prompt=True, return_dict=False),
    "ids": [engine.encode(text), tok.encode(text)]}))
"""


def test_engine_start_does_not_import_transformers(smollm_gguf):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["after_start"] is False, "building and running the engine imported transformers"
    assert out["engine_type"] == "FastTokenizer" and out["picked"] in ("yes", "no")
    assert out["hf_is_fast"] and out["same_object"]  # built once, then kept
    assert out["hf_chat_ids"] == out["chat_ids"]
    assert out["ids"][0] == out["ids"][1]
