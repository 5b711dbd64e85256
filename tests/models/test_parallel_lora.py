"""LoRA adapters under tensor and pipeline parallelism, on the tiny Llama 3 (4 heads, 2 KV
heads, 128 intermediate rows: they split over two ranks) with a random peft adapter on all
seven projections, requests with and without it in one batch: with tensor_parallel_size=2 (A
and B split as their base layer: q/k/v and gate/up by B's rows, o_proj and down_proj by A's
columns, the deltas summed in the base's all-reduce) and with pipeline_parallel_size=2 (each
stage its layers' matrices), greedy tokens equal one process's and the first position's
log-probabilities agree within 1e-3 (float32; Q8_0 blocks kept: within their 8-bit activations'
tolerance, as the base model's TP test). A rank holds, in its slots and its read copy, the
bytes the memory plan counts for it."""
from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.config import LoRAConfig
from pagedllm.memory.footprint import lora_bytes
from pagedllm.worker.lora_slots import LoRASlots
from test_llama3 import llama3  # noqa: F401  (the module's fixtures: the tiny checkpoints)
from test_tensor_parallel_families import (BLOCKS_LOGPROB_TOL, LOGPROB_TOL,
                                           _check_tp_against_single, _load_rank)
from tiny_models import CHUNKED, NUM_TOKENS

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def adapter(llama3, tmp_path_factory) -> LoRARequest:  # noqa: F811
    """peft's random A and B (init_lora_weights=False), r=8 on every projection."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(3)
    base = AutoModelForCausalLM.from_pretrained(str(llama3.hf_dir), dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=PROJECTIONS,
                                            init_lora_weights=False))
    path = tmp_path_factory.mktemp("lora-llama3") / "adapter"
    model.save_pretrained(str(path))
    return LoRARequest("adapter", 1, str(path))


def _greedy(llm: LLM, token_prompts: list[list[int]], adapter: LoRARequest) -> list:
    """Each prompt with the adapter, then without: greedy tokens and each position's top-20
    {token: logprob}."""
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=20)
    prompts = [{"prompt_token_ids": p} for p in token_prompts for _ in (0, 1)]
    outs = llm.generate(prompts, params, lora_request=[adapter, None] * len(token_prompts),
                        use_tqdm=False)
    return [(list(o.outputs[0].token_ids),
             [{t: lp.logprob for t, lp in pos.items()} for pos in o.outputs[0].logprobs])
            for o in outs]


def _single_and_parallel(engine: dict, adapter: LoRARequest, prompts: list[list[int]],
                         **parallel: int) -> tuple[list, list]:
    want = _greedy(LLM(**engine), prompts, adapter)
    with_adapter, without = [w[0] for w in want[0::2]], [w[0] for w in want[1::2]]
    assert with_adapter != without  # the adapter changes the text
    llm = LLM(**engine, **parallel)
    try:
        return want, _greedy(llm, prompts, adapter)
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("checkpoint", ["hf_dir", "q8_0_gguf"])
def test_tp2_with_an_adapter_equals_one_process(llama3, adapter, checkpoint):  # noqa: F811
    engine = dict(model=str(getattr(llama3, checkpoint)), tokenizer=str(llama3.hf_dir),
                  dtype="float32", enable_lora=True, max_lora_rank=8, **CHUNKED)
    want, got = _single_and_parallel(engine, adapter, llama3.prompts, tensor_parallel_size=2)
    if checkpoint == "hf_dir":  # float32 throughout: the same tokens, logprobs within 1e-3
        assert [g[0] for g in got] == [w[0] for w in want]
    _check_tp_against_single(got, want, LOGPROB_TOL if checkpoint == "hf_dir" else
                             BLOCKS_LOGPROB_TOL)


def test_pp2_with_an_adapter_equals_one_process(llama3, adapter):  # noqa: F811
    engine = dict(model=str(llama3.hf_dir), dtype="float32", enable_lora=True, max_lora_rank=8,
                  **CHUNKED)
    want, got = _single_and_parallel(engine, adapter, llama3.prompts, pipeline_parallel_size=2)
    assert [g[0] for g in got] == [w[0] for w in want]
    _check_tp_against_single(got, want, LOGPROB_TOL)


def test_a_rank_holds_the_adapter_bytes_its_plan_counts(llama3, adapter):  # noqa: F811
    """Rank 1 of 2: one slot and one read adapter of rank 8, its part of each matrix (B's
    rows of q/k/v and gate/up, A's columns of o_proj and down_proj): lora_bytes' share."""
    model = _load_rank(llama3.q8_0_gguf, 1)
    config = LoRAConfig(max_loras=1, max_lora_rank=8, max_cpu_loras=1)
    slots = LoRASlots(model, model.config, config, torch.device("cpu"))
    read = slots._adapter(adapter)
    slots._load(0, read)
    held = sum(w.a.nbytes + sum(bt.nbytes for bt in w.bt) for w in slots.wrappers)
    held += sum(a.nbytes + b.nbytes for a, b in read.weights.values())
    a, b = read.weights[(0, "o_proj")]
    assert a.shape == (8, 32) and b.shape == (64, 8)  # o_proj's input columns split
    a, b = read.weights[(0, "q_proj")]
    assert a.shape == (8, 64) and b.shape == (32, 8)  # q_proj's output rows split
    assert held == lora_bytes(model.config, config, tp_size=2) // 2
