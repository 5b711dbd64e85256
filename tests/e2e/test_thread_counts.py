"""An engine's tokens and logprobs do not depend on how many threads it runs.

Every kernel splits its work over threads by output (weight groups, heads, sequences) and keeps
each output's sums in one thread, so one thread and two give the same bits. The suite's first
part runs each engine on one pinned CPU, so this file runs in the alone part (tests/conftest.py),
with the machine's threads: the default model's GGUF (kept blocks, the C++ decode step), its
float32 HF export with bf16 matrices and with int8 and int8_g128 at load (pagedllm's bf16 and
Q8_0 kernels: x rounded to bf16 or int8 in the kernel, on the AMX tiles where the CPU has them),
and a bf16 checkpoint with dtype="auto" (SmolLM2's export, as tests/e2e/test_bf16_hf_dir.py makes
it); prompts long enough for the gemm and the AMX passes (32 rows and more) in the prompt step,
then decode steps of 3 rows. Prefix caching is off: the second run would otherwise take the
prompts' first blocks from the cache and attend over them in other shapes, which moved the GGUF's
and int8's logprobs (not their tokens) on an AVX512-VNNI Zen 4 whatever the threads.
dtype="bfloat16" on a float32 checkpoint (PyTorch's own bf16 matmuls, vLLM's behaviour) is not
among them: its logprobs moved by up to 0.24 between 1 and 2 threads here.
"""
from __future__ import annotations

import os

import pytest
import torch

from helpers import save_bf16_export
from pagedllm import LLM, SamplingParams

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number, iteratively, with a docstring "
    "that explains its arguments, its return value and what it raises on a negative n.",
    "List three differences between a list and a tuple in Python, one sentence each, and say which "
    "of the two can be a key of a dictionary and why that is so.",
    "def quicksort(xs):\n    \"\"\"Sort xs and return a new list, leaving xs as it was; the pivot is "
    "the middle element.\"\"\"\n",
]

ENGINE = dict(max_model_len=1024, enable_prefix_caching=False)  # each run computes every prompt
needs_two = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2,
                               reason="needs two CPUs to compare 1 and 2 threads")


def outputs(llm: LLM) -> list:
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, ignore_eos=True)
    done = llm.generate(PROMPTS, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
            for o in done]


def one_and_two_threads(llm: LLM) -> tuple[list, list]:
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = outputs(llm)
        torch.set_num_threads(1)
        one = outputs(llm)
    finally:
        torch.set_num_threads(threads)
    return one, two


@pytest.fixture(scope="module")
def smollm_bf16_dir(smollm_hf_dir, tmp_path_factory):
    return save_bf16_export(smollm_hf_dir, tmp_path_factory.mktemp("smollm-bf16"))


@needs_two
@pytest.mark.parametrize("form", ["gguf", "bf16", "int8", "int8_g128", "bf16_checkpoint"])
def test_one_thread_and_two_give_the_same_tokens_and_logprobs(form: str,
                                                              request: pytest.FixtureRequest) -> None:
    if form == "gguf":
        llm = LLM(model=str(request.getfixturevalue("qwen_gguf")), **ENGINE)
    elif form == "bf16_checkpoint":
        llm = LLM(model=str(request.getfixturevalue("smollm_bf16_dir")), **ENGINE)
    else:  # the float32 export, its matrices in bf16 or quantized at load (pagedllm's kernels)
        llm = LLM(model=str(request.getfixturevalue("qwen_hf_dir")), quantization=form, **ENGINE)
    assert llm.llm_engine.config.quantization == {"gguf": "gguf", "bf16_checkpoint": "bf16"}.get(form, form)
    one, two = one_and_two_threads(llm)
    assert [ids for ids, _ in one] == [ids for ids, _ in two]
    assert one == two  # every logprob to the bit
    assert all(len(ids) == 12 for ids, _ in one)
