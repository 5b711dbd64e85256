"""LoRA adapters made with peft (random A and B: init_lora_weights=False) on SmolLM2-135M and
the default model (Qwen2.5-Coder-0.5B, whose q/k/v have biases).

- float32 HF checkpoints: pagedllm's logprobs within 1e-3 of transformers + peft, greedy tokens
  identical, for all seven projections and for three of them with rsLoRA;
- the GGUF with its blocks kept (the base stays quantized, the adapter float32): a batch of
  adapter 1, adapter 2 and the base in one step equals each request run alone, bit for bit,
  and the C++ decode stack (which applies LoRA itself) equals the model's layer loop;
  with max_loras=1 the adapters evict each other and the outputs stay the same; the prefix
  cache never serves one adapter's blocks to another;
- the first adapter written as llama.cpp's GGUF LoRA adapter gives the same tokens and logprobs,
  bit for bit, as its PEFT original.
"""
from __future__ import annotations

import gc
import logging
from pathlib import Path

import pytest
import torch

from helpers import model_runner
from pagedllm import LLM, LoRARequest, SamplingParams

PROMPTS = ["The capital of France is Paris, and the capital of Germany is", "def fibonacci(n):",
           "Once upon a time"]
GREEDY = SamplingParams(temperature=0, max_tokens=8, logprobs=3, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(smollm_lora_adapters) -> list[LoRARequest]:
    return smollm_lora_adapters


def _peft_model(hf_dir, adapter: LoRARequest):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter.lora_path).eval()


@pytest.mark.parametrize("model", ["smollm", "qwen"])
def test_float32_logprobs_and_greedy_tokens_match_transformers_with_peft(model, request):
    hf_dir = request.getfixturevalue(f"{model}_hf_dir")
    adapters = request.getfixturevalue(f"{model}_lora_adapters")
    llm = LLM(str(hf_dir), dtype="float32", enable_lora=True, max_loras=2,
              max_lora_rank=8, max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=5, logprobs=5)
    outs = llm.generate([PROMPTS[0]] * 2, params, lora_request=adapters, use_tqdm=False)
    del llm
    gc.collect()
    for adapter, out in zip(adapters, outs):
        model = _peft_model(hf_dir, adapter)
        prompt, tokens = out.prompt_token_ids, list(out.outputs[0].token_ids)
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)
            logprobs = torch.log_softmax(model(torch.tensor([prompt + tokens])).logits[0], -1)
            with model.disable_adapter():
                base = torch.log_softmax(model(torch.tensor([prompt])).logits[0], -1)
        assert tokens == ref[0, len(prompt):].tolist(), adapter.lora_name
        ours = [(p - 1, d) for p, d in enumerate(out.prompt_logprobs) if d is not None]
        ours += [(len(prompt) - 1 + j, d) for j, d in enumerate(out.outputs[0].logprobs)]
        worst = max(abs(logprobs[pos, tok].item() - lp.logprob)
                    for pos, d in ours for tok, lp in d.items())
        assert worst < 1e-3, (adapter.lora_name, worst)
        # the adapter matters: the base model's log-probabilities are far from these
        assert (base - logprobs[:len(prompt)]).abs().max() > 1.0
        del model
        gc.collect()


def _texts(outs) -> list[tuple[list[int], list[list[tuple[int, float]]]]]:
    """Each output's tokens and its logprobs exactly (token id, value) per position."""
    return [(list(o.outputs[0].token_ids),
             [sorted((t, lp.logprob) for t, lp in d.items()) for d in o.outputs[0].logprobs])
            for o in outs]


@pytest.fixture(scope="module")
def gguf_llm(smollm_gguf, adapters):
    llm = LLM(str(smollm_gguf), enable_lora=True, max_loras=2, max_lora_rank=8,
              max_model_len=256)
    yield llm
    del llm
    gc.collect()


def _mixed_batch_equals_alone_and_the_layer_loop(llm: LLM, adapters) -> None:
    """On llm's C++ decode stack with LoRA: adapter 1, adapter 2 and the base in one batch equal
    each request alone (tokens and logprobs, bit for bit), the adapters change the text, and the
    model's layer loop (LoRALinear's C++ op) gives the stack's bits."""
    runner = model_runner(llm)
    assert runner.captured_decode is not None and runner._stack_lora  # LoRA in the C++ stack
    loras = [adapters[0], adapters[1], None]
    mixed = _texts(llm.generate(PROMPTS, GREEDY, lora_request=loras, use_tqdm=False))
    alone = [_texts(llm.generate([p], GREEDY, lora_request=lora, use_tqdm=False))[0]
             for p, lora in zip(PROMPTS, loras)]
    assert mixed == alone
    base = _texts(llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False))
    assert [m[0] for m in mixed[:2]] != [b[0] for b in base]
    captured, runner.captured_decode = runner.captured_decode, None
    try:
        loop = _texts(llm.generate(PROMPTS, GREEDY, lora_request=loras, use_tqdm=False))
    finally:
        runner.captured_decode = captured
    assert loop == mixed


def test_a_mixed_batch_equals_each_request_alone_over_kept_gguf_blocks(gguf_llm, adapters,
                                                                         caplog):
    assert gguf_llm.llm_engine.config.quantization == "gguf"  # the base stays quantized
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        _mixed_batch_equals_alone_and_the_layer_loop(gguf_llm, adapters)
    assert "decode steps with a LoRA adapter run the model's layer loop" not in caplog.text


def test_the_engine_names_the_adapters_of_waiting_and_running_requests(gguf_llm, adapters):
    """What /metrics' vllm:lora_requests_info reads."""
    engine = gguf_llm.llm_engine
    engine.add_request("w1", PROMPTS[0], GREEDY, adapters[1])
    engine.add_request("w2", PROMPTS[1], GREEDY, adapters[0])
    engine.add_request("w3", PROMPTS[2], GREEDY)
    assert engine.lora_names() == ((), ("adapter1", "adapter2"))
    engine.step()
    assert engine.lora_names() == (("adapter1", "adapter2"), ())
    engine.abort_request(["w1", "w2", "w3"])
    assert engine.lora_names() == ((), ())


def test_the_prefix_cache_never_shares_blocks_across_adapters(gguf_llm, adapters):
    kv = gguf_llm.llm_engine.engine_core.kv_manager
    prompt = PROMPTS[0] * 4  # several full blocks
    runs = {}
    for name, lora in [("one", adapters[0]), ("two", adapters[1]), ("base", None),
                       ("one again", adapters[0])]:
        before = kv.prefix_hits
        runs[name] = _texts(gguf_llm.generate([prompt], GREEDY, lora_request=lora,
                                              use_tqdm=False))[0]
        runs[name + " hits"] = kv.prefix_hits - before
    assert runs["two hits"] == runs["base hits"] == 0
    assert runs["one again hits"] >= 32 and runs["one again"] == runs["one"]
    assert len({str(runs[k]) for k in ("one", "two", "base")}) == 3  # logprobs differ


def test_a_gguf_adapter_gives_the_logprobs_of_its_peft_original(gguf_llm, adapters, smollm_gguf,
                                                               lora_gguf_writer, tmp_path):
    """llama.cpp's layout (convert_lora_to_gguf.py), f32: SmolLM2 is the llama architecture, so
    q/k's lora_b rows come permuted and are put back; the same matrices give the same bits."""
    arch = gguf_llm.llm_engine.config.arch
    path = lora_gguf_writer(Path(adapters[0].lora_path), tmp_path / "adapter1.gguf", "llama",
                            arch.head_dim)
    as_gguf = LoRARequest("adapter1-gguf", 11, str(path))
    outs = [_texts(gguf_llm.generate(PROMPTS, GREEDY, lora_request=lora, use_tqdm=False))
            for lora in (adapters[0], as_gguf)]
    assert outs[0] == outs[1]  # tokens and logprobs, bit for bit
    not_adapter = LoRARequest("model", 12, str(smollm_gguf))
    with pytest.raises(ValueError, match="general.type=.*: not a LoRA adapter"):
        gguf_llm.generate(PROMPTS[0], GREEDY, lora_request=not_adapter, use_tqdm=False)


def test_eviction_with_one_slot_leaves_no_stale_weights(smollm_gguf, adapters, gguf_llm):
    expected = [_texts(gguf_llm.generate([PROMPTS[0]], GREEDY, lora_request=lora,
                                         use_tqdm=False))[0] for lora in adapters]
    llm = LLM(str(smollm_gguf), enable_lora=True, max_loras=1, max_lora_rank=8,
              max_model_len=256, enable_prefix_caching=False)
    order = [0, 1, 0, 1, 1, 0]
    got = [_texts(llm.generate([PROMPTS[0]], GREEDY, lora_request=adapters[i],
                               use_tqdm=False))[0] for i in order]
    assert got == [expected[i] for i in order]
    # one call over both adapters: the scheduler runs them one slot at a time
    both = _texts(llm.generate([PROMPTS[0]] * 3, GREEDY,
                               lora_request=[adapters[0], adapters[1], None], use_tqdm=False))
    assert both[:2] == expected
    del llm
    gc.collect()


def test_lora_requests_are_refused_by_name(smollm_gguf, gguf_llm, adapters, tmp_path):
    with pytest.raises(ValueError, match="lora_request has 2 entries but there are 3 prompts"):
        gguf_llm.generate(PROMPTS, GREEDY, lora_request=adapters, use_tqdm=False)
    big = LoRARequest("big", 9, adapters[0].lora_path)
    small = LLM(str(smollm_gguf), enable_lora=True, max_lora_rank=4, max_model_len=128)
    with pytest.raises(ValueError, match="r=8 is over max_lora_rank=4"):
        small.generate(PROMPTS[0], GREEDY, lora_request=big, use_tqdm=False)
    assert small.llm_engine.has_unfinished_requests() is False
    del small
    gc.collect()


@pytest.mark.parametrize("quantization", ["bf16", "int8", "int8_g128"])
def test_adapters_over_an_hf_checkpoints_fast_path(quantization, smollm_hf_dir, adapters):
    """An HF checkpoint on pagedllm's own kernels (bf16 matrices, int8 or int8_g128 at load)
    with adapters: a mixed batch equals each request alone, bit for bit, the C++ decode stack
    (LoRA applied in it) equals the layer loop, and the adapters change the text."""
    llm = LLM(str(smollm_hf_dir), quantization=quantization, enable_lora=True, max_loras=2,
              max_lora_rank=8, max_model_len=256)
    try:
        assert llm.llm_engine.config.quantization == quantization
        _mixed_batch_equals_alone_and_the_layer_loop(llm, adapters)
    finally:
        del llm
        gc.collect()
