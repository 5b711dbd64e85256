"""Tensor parallelism across the decoder families, on tiny random models whose shapes split over
two ranks: with tensor_parallel_size=2, greedy tokens equal one process's and the first
position's log-probabilities agree within 1e-3 (TP's all-reduce changes the summation order of
o_proj and down_proj), from the HF directory (safetensors read by slices); from the Q8_0 GGUF
(kept blocks: q/k/v and gate/up by block rows, o_proj and down_proj by whole blocks of every
row) and with int8/int4 at load, whose 8-bit activations turn the order's last bits into a
rounding step, within 0.02 and the same tokens but at the one process's near-ties. Prompts in
chunks with the prefix cache on.

- a tiny Qwen2 with one KV head (replicated on both ranks, as vLLM does) and q/k/v biases
  (sharded with their rows);
- Llama 3 (the GGUF's permuted Q/K rows, un-permuted per head on each rank's part);
- Qwen3 (per-head q/k norms; head_dim 32 unlike hidden / heads).
Phi-3's fused tensors and the MoE blocks: test_tensor_parallel_fused_moe.py; experts whose
down_proj rows are fewer GGUF blocks than ranks are refused with the tensor named.
"""
from __future__ import annotations

import shutil

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.distributed.tensor_parallel import TensorParallelRank
from pagedllm.loader.checkpoint import resolve_checkpoint
from pagedllm.platforms.cpu import CpuPlatform
from pagedllm.worker.model_loader import load_model
from pagedllm.worker.x8_weight_file import cache_path
from test_llama3 import llama3  # noqa: F401  (the module's fixtures: the tiny checkpoints)
from test_qwen3 import qwen3  # noqa: F401
from test_qwen3_moe import qwen3_moe  # noqa: F401
from tiny_models import (CHUNKED, NUM_TOKENS, VOCAB, base_fields, prompts, random_init,
                         save_checkpoints, save_hf_dir)

LOGPROB_TOL = 1e-3
# Block weights run with 8-bit activations: an activation on a rounding boundary may round the
# other way after TP's other summation order, one quantization step (measured: 1.7e-3, int8, on
# AVX2; 0.034 on an AVX512-VNNI Xeon, Q8_0, and 0.026 for PP's batches there)
BLOCKS_LOGPROB_TOL = 0.05
# how close the one process's two best choices must be where TP=2 picks the other one (Q8_0)
NEAR_TIE = 0.05


def _tiny_qwen2(hidden: int, intermediate: int, heads: int, kv_heads: int,
                scale: float) -> Qwen2ForCausalLM:
    """A two-layer Qwen2 of these sizes (q/k/v biases, tied embeddings), weights drawn at scale."""
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=True,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    model = Qwen2ForCausalLM(cfg).eval()
    random_init(model, seed=0, scale=scale)
    return model


@pytest.fixture(scope="module")
def qwen2_one_kv_head(tmp_path_factory):
    """A tiny Qwen2: 4 query heads sharing one KV head, q/k/v biases, tied embeddings."""
    model = _tiny_qwen2(64, 128, 4, 1, scale=0.2)
    return save_checkpoints(model, tmp_path_factory.mktemp("qwen2"), "qwen2",
                            lambda w: base_fields(w, model.config), prompts((5, 23, 40, 61), seed=1))


def _greedy(llm: LLM, token_prompts: list[list[int]]) -> list[tuple[list[int], list[dict]]]:
    """Each prompt's greedy continuation (ignoring EOS), with the top-20 log-probabilities
    {token: logprob} of every position."""
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=20)
    outs = llm.generate([{"prompt_token_ids": p} for p in token_prompts], params,
                        use_tqdm=False)
    return [(list(o.outputs[0].token_ids),
             [{t: lp.logprob for t, lp in pos.items()} for pos in o.outputs[0].logprobs])
            for o in outs]


def _check_tp_against_single(got: list, want: list, tol: float = BLOCKS_LOGPROB_TOL) -> None:
    """The first position's log-probabilities within tol; the same greedy tokens, but where
    the one process was at a near-tie (its two choices within NEAR_TIE of each other): block
    weights run with 8-bit activations, and an activation on a rounding boundary may round
    the other way after TP's other summation order, moving logits by more than float32's
    1e-3."""
    for (tokens, lps), (want_tokens, want_lps) in zip(got, want):
        first, want_first = lps[0], want_lps[0]
        assert max(abs(first[t] - want_first[t]) for t in first.keys() & want_first.keys()
                   ) <= tol
        if tokens == want_tokens:
            continue
        i = next(i for i, (a, b) in enumerate(zip(tokens, want_tokens)) if a != b)
        single = want_lps[i]
        assert tokens[i] in single and single[want_tokens[i]] - single[tokens[i]] <= NEAR_TIE, (
            i, single[want_tokens[i]], single.get(tokens[i]))


def _tp2(engine: dict, prompts: list[list[int]]) -> list:
    """_greedy of tensor_parallel_size=2 on these engine arguments."""
    llm = LLM(**engine, tensor_parallel_size=2)
    try:
        return _greedy(llm, prompts)
    finally:
        llm.llm_engine.shutdown()


def _single_and_tp2(engine: dict, prompts: list[list[int]]) -> tuple[list, list]:
    """_greedy of one process, then of tensor_parallel_size=2, on the same engine arguments."""
    return _greedy(LLM(**engine), prompts), _tp2(engine, prompts)


@pytest.mark.parametrize("checkpoint", ["hf_dir", "q8_0_gguf"])
@pytest.mark.parametrize("family", ["qwen2_one_kv_head", "llama3", "qwen3"])
def test_tp2_equals_one_process(request, family, checkpoint):
    ckpts = request.getfixturevalue(family)
    # the GGUFs hold no tokenizer: the HF directory's
    engine = dict(model=str(getattr(ckpts, checkpoint)), tokenizer=str(ckpts.hf_dir),
                  dtype="float32", **CHUNKED)
    want, got = _single_and_tp2(engine, ckpts.prompts)
    if checkpoint == "hf_dir":  # float32 throughout: the same tokens, logprobs within 1e-3
        assert [g[0] for g in got] == [w[0] for w in want]
    _check_tp_against_single(got, want, LOGPROB_TOL if checkpoint == "hf_dir" else
                             BLOCKS_LOGPROB_TOL)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_tp2_quantized_at_load_equals_one_process(qwen2_one_kv_head, quantization):
    """A float checkpoint quantized at load: each rank quantizes its own part (int4: Q4_1
    blocks of 32 values, o_proj's 32 and down_proj's 64 values per rank whole blocks)."""
    ckpts = qwen2_one_kv_head
    engine = dict(model=str(ckpts.hf_dir), dtype="float32", quantization=quantization)
    want, got = _single_and_tp2(engine, ckpts.prompts)
    _check_tp_against_single(got, want)


@pytest.fixture(scope="module")
def qwen2_groups(tmp_path_factory):
    """A tiny Qwen2 whose rows are 384 values (3 groups of 128) with 6 heads of 64: a rank's
    part of o_proj (3 heads, 192 values) cuts a group, the other matrices split at whole ones.
    Its HF directory and prompts."""
    model = _tiny_qwen2(384, 512, 6, 2, scale=0.1)
    return save_hf_dir(model, tmp_path_factory.mktemp("qwen2_groups")), prompts((5, 23, 40), seed=1)


def test_tp2_int8_g128_keeps_q8_0_where_a_rank_cuts_a_group(qwen2_groups, monkeypatch):
    """int8_g128 with tensor_parallel_size=2: each rank's o_proj (192 values a rank) keeps
    Q8_0's scale per 32 values, every other matrix its groups of 128 (rank 1 loaded here); the
    two ranks give the tokens and log-probabilities, within the 8-bit activations' tolerance,
    of one process whose plan has the same formats (its o_proj made Q8_0 too: one process alone
    keeps o_proj's whole rows in groups, other weights)."""
    from pagedllm.kernels.types import Q8_0G4
    from pagedllm.layers.quantization import Q8_0
    from pagedllm.worker import model_loader

    hf_dir, token_prompts = qwen2_groups
    engine = dict(model=str(hf_dir), dtype="float32", quantization="int8_g128", **CHUNKED)
    plan_of = model_loader.float_quant_plan

    def o_proj_in_q8_0(model, method):
        plan = plan_of(model, method)
        return {p: Q8_0 if p.endswith(".o_proj") else q for p, q in plan.items()}

    with monkeypatch.context() as m:
        m.setattr(model_loader, "float_quant_plan", o_proj_in_q8_0)
        single = LLM(**engine)
        want = _greedy(single, token_prompts)
        single.llm_engine.shutdown()
    _check_tp_against_single(_tp2(engine, token_prompts), want)

    platform = CpuPlatform()
    platform.load_kernels()
    config = EngineConfig(model_path=str(hf_dir), arch=resolve_checkpoint(hf_dir).arch,
                          dtype=torch.float32, platform=platform, quantization="int8_g128")
    layer = load_model(config, tp=TensorParallelRank(1, 2)).model.layers[0]
    assert layer.self_attn.o_proj.inner.qtype == Q8_0 and layer.self_attn.o_proj.inner.in_features == 192
    assert set(layer.self_attn.qkv_proj.qtypes) == {Q8_0G4}
    assert layer.mlp.down_proj.inner.qtype == Q8_0G4 and layer.mlp.down_proj.inner.in_features == 256


def test_tp2_with_file_backed_blocks_equals_one_process(qwen2_one_kv_head):
    """mmap_weights: each rank maps its own regrouped blocks from a cache file of its part."""
    ckpts = qwen2_one_kv_head
    engine = dict(model=str(ckpts.q8_0_gguf), tokenizer=str(ckpts.hf_dir), dtype="float32",
                  mmap_weights=True)
    try:
        want, got = _single_and_tp2(engine, ckpts.prompts)
    finally:  # the ranks wrote to the real cache: a temporary GGUF's copies go with it
        shutil.rmtree(cache_path(ckpts.q8_0_gguf).parent, ignore_errors=True)
    _check_tp_against_single(got, want)
    assert not cache_path(ckpts.q8_0_gguf).parent.exists()


def _load_rank(path, rank: int):
    ckpt = resolve_checkpoint(path)
    platform = CpuPlatform()
    platform.load_kernels()  # the x8 packing's
    config = EngineConfig(model_path=str(path), arch=ckpt.arch, dtype=torch.float32,
                          platform=platform, quantization="gguf")
    return load_model(config, tp=TensorParallelRank(rank, 2))


def test_a_rank_holds_its_part_of_the_blocks_and_the_replicated_kv_head(qwen2_one_kv_head):
    """Rank 1 of the Q8_0 GGUF: query heads 2-3 and KV head 0, every matrix still in blocks
    (packed for the x8 kernels: its rows split into groups of 8)."""
    model = _load_rank(qwen2_one_kv_head.q8_0_gguf, 1)
    attn = model.model.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads) == (2, 1)
    assert attn.qkv_proj.output_sizes == (32, 16, 16) and attn.qkv_proj.packed
    assert attn.o_proj.inner.in_features == 32 and attn.o_proj.inner.packed
    assert model.model.layers[0].mlp.down_proj.inner.in_features == 64


def test_experts_of_fewer_blocks_than_ranks_are_refused_by_name(qwen3_moe):
    """moe_intermediate_size 32: one Q8_0 block an expert's down_proj row (stacked in
    ffn_down_exps), which two ranks cannot share; the float32 GGUF splits it 16/16."""
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2: model\.layers\.0\.mlp\."
                                         r"experts\.0\.down_proj\.weight, kept in Q8_0 "
                                         r"blocks, has 32 values a row"):
        _load_rank(qwen3_moe.q8_0_gguf, 0)
    block = _load_rank(qwen3_moe.f32_gguf, 1).model.layers[0].mlp
    assert block.inner.experts[7].down_proj.in_features == 16  # one all-reduce: the block's


def test_a_down_proj_of_fewer_blocks_than_ranks_is_refused_by_name(tmp_path):
    """intermediate_size 32: one Q8_0 block a down_proj row, which two ranks cannot share at a
    block boundary; the float32 GGUF of the same model splits it 16/16."""
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=32,
                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, tie_word_embeddings=True,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    model = Qwen2ForCausalLM(cfg).eval()
    random_init(model, seed=0)
    ckpts = save_checkpoints(model, tmp_path, "qwen2", lambda w: base_fields(w, cfg),
                             prompts((5,), seed=1))
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2: model\.layers\.0\.mlp\."
                                         r"down_proj\.weight, kept in Q8_0 blocks, has 32 "
                                         r"values a row, 1 blocks of 32, which cannot be split"):
        _load_rank(ckpts.q8_0_gguf, 0)
    assert _load_rank(ckpts.f32_gguf, 1).model.layers[0].mlp.down_proj.inner.in_features == 16
