"""The greedy head screen in the engine (layers/head_screen.py): a bf16 checkpoint's plain greedy
rows take it, every other row the logits and the sampler, and a batch mixing them gives the
very tokens and logprobs the full head gives; its bytes are in the memory plan; off by
PAGEDLLM_HEAD_SCREEN=0, and never for a head it cannot copy."""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from e2e.helpers import model_runner
from pagedllm import LLM, SamplingParams
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.config_builder import plan_engine_memory
from pagedllm.kernels import kernels_available
from pagedllm.memory.head_screen import ENV, screen_bytes
from pagedllm.loader.checkpoint import resolve_checkpoint
from tiny_models import VOCAB, prompts, random_init, save_hf_dir

pytestmark = pytest.mark.skipif(not kernels_available(), reason="CPU kernels unavailable")

OPTS = dict(max_model_len=256, max_num_batched_tokens=64, block_size=16)


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, tie_word_embeddings=True)
    model = Qwen2ForCausalLM(cfg).eval()
    random_init(model, seed=11, scale=0.2)
    return save_hf_dir(copy.deepcopy(model).to(torch.bfloat16),
                       tmp_path_factory.mktemp("screen") / "hf")


@pytest.fixture(scope="module")
def engines(bf16_dir):
    """(screened, full): the same checkpoint with the screen and with PAGEDLLM_HEAD_SCREEN=0."""
    screened = LLM(model=str(bf16_dir), **OPTS)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENV, "0")
        full = LLM(model=str(bf16_dir), **OPTS)
    return screened, full


def test_planned_and_built_for_bf16_matrices_only(engines):
    screened, full = engines
    runner = model_runner(screened)
    assert screened.llm_engine.config.head_screen and runner.head_screen is not None
    assert runner.head_screen.nbytes == screen_bytes(screened.llm_engine.config.arch)
    assert not full.llm_engine.config.head_screen and model_runner(full).head_screen is None


def test_the_plan_holds_its_bytes(bf16_dir, monkeypatch):
    ckpt = resolve_checkpoint(str(bf16_dir))
    args = EngineArgs(str(bf16_dir), **OPTS)
    from pagedllm.platforms import resolve_platform
    platform = resolve_platform("cpu").platform
    def weights(quantization: str) -> int:
        return plan_engine_memory(args, ckpt, platform, torch.float32, quantization)[0].weight_bytes
    with_screen, int8 = weights("bf16"), weights("int8")
    monkeypatch.setenv(ENV, "0")
    assert with_screen - weights("bf16") == screen_bytes(ckpt.arch)
    assert weights("int8") == int8  # an int8 head has none


def _mixed() -> list[SamplingParams]:
    """Plain greedy rows beside rows the screen must leave to the sampler."""
    plain = dict(max_tokens=12, ignore_eos=True)
    return [SamplingParams(temperature=0, **plain),
            SamplingParams(temperature=0, logprobs=3, **plain),
            SamplingParams(temperature=0.8, seed=7, **plain),
            SamplingParams(temperature=0, repetition_penalty=1.3, **plain),
            SamplingParams(temperature=0, min_tokens=6, max_tokens=12),
            SamplingParams(temperature=0, logit_bias={5: 3.0}, **plain),
            SamplingParams(temperature=0, allowed_token_ids=list(range(40, 90)), **plain),
            SamplingParams(temperature=0, **plain)]


def test_a_mixed_batch_gives_the_full_heads_tokens(engines, monkeypatch):
    screened, full = engines
    screen = model_runner(screened).head_screen
    seen = []
    argmax = screen.argmax
    monkeypatch.setattr(screen, "argmax",
                        lambda x, step_rows=0: seen.append(x.shape[0]) or argmax(x, step_rows))
    params = _mixed()
    token_prompts = prompts((9, 17, 30, 5, 12, 21, 8, 40), seed=4)
    reqs = [{"prompt_token_ids": p} for p in token_prompts]
    got = screened.generate(reqs, params, use_tqdm=False)
    ref = full.generate(reqs, params, use_tqdm=False)
    for g, r in zip(got, ref):
        assert g.outputs[0].token_ids == r.outputs[0].token_ids
        assert g.outputs[0].logprobs == r.outputs[0].logprobs
    # every step screened the two plain rows (and the min_tokens row once it had 6 tokens), no
    # more: a row with logprobs, penalties, bias, allowed ids or a temperature never reaches it
    assert seen and max(seen) <= 3 and sum(seen) >= 2 * 12


def test_the_screen_decides_what_the_full_head_would(engines):
    """Long greedy runs on their own: the same tokens, every row decided by the screen."""
    screened, full = engines
    runner = model_runner(screened)
    decided = []
    argmax = runner.head_screen.argmax

    def counted(x, step_rows=0):
        out = argmax(x, step_rows)
        decided.append(int((out >= 0).sum()) == x.shape[0])
        return out
    runner.head_screen.argmax = counted
    try:
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        reqs = [{"prompt_token_ids": p} for p in prompts((6, 25, 33), seed=9)]
        got = [o.outputs[0].token_ids for o in screened.generate(reqs, params, use_tqdm=False)]
        ref = [o.outputs[0].token_ids for o in full.generate(reqs, params, use_tqdm=False)]
    finally:
        del runner.head_screen.argmax
    assert got == ref
    assert decided and all(decided)
