"""ModelRunner on the real SmolLM2 GGUF, driven by hand-made SchedulerOutputs (no scheduler)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from pagedllm.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.config_builder import make_engine_config
from pagedllm.layers.attention import Attention
from pagedllm.loader.checkpoint import resolve_checkpoint
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.worker import Worker

GREEDY = SamplingParams(temperature=0, max_tokens=64)
PROMPT = [1, 504, 3458, 282, 4649, 314, 216]  # 7 tokens
BLOCKS = 64


@pytest.fixture(scope="module")
def runner(smollm_gguf):
    args = EngineArgs(model=str(smollm_gguf), max_model_len=256, max_num_seqs=4,
                      max_num_batched_tokens=64, block_size=4)
    config = make_engine_config(args, resolve_checkpoint(smollm_gguf))
    worker = Worker(dataclasses.replace(config, eos_token_ids=(2,)))
    worker.init_device()
    worker.load_model()
    worker.initialize_kv_cache(BLOCKS)
    return worker.model_runner


def _new(req_id: str, tokens: list[int], blocks: list[int], params=GREEDY) -> NewRequestData:
    return NewRequestData(req_id, list(tokens), len(tokens), params, blocks, 0)


def _step(runner, new=(), cached=(), finished=()) -> dict[str, int]:
    sched_tokens = {r.req_id: len(r.token_ids) - r.num_computed_tokens for r in new}
    sched_tokens.update({c.req_id: 1 for c in cached})
    out = runner.execute_model(SchedulerOutput(list(new), list(cached), sched_tokens,
                                               set(finished)))
    return out.sampled


def _generate(runner, reqs: dict[str, tuple[list[int], list[int]]], steps: int) -> dict[str, list[int]]:
    """Prefill each request, then decode `steps` tokens for all of them together."""
    tokens = {r: [] for r in reqs}
    for r, tok in _step(runner, new=[_new(r, p, b) for r, (p, b) in reqs.items()]).items():
        tokens[r].append(tok)
    for _ in range(steps):
        cached = [CachedRequestData(r, [], len(p) + len(tokens[r]) - 1, tokens[r][-1:])
                  for r, (p, _) in reqs.items()]
        for r, tok in _step(runner, cached=cached).items():
            tokens[r].append(tok)
    _step(runner, finished=reqs)
    return tokens


def test_every_attention_layer_is_bound_to_its_cache_slice(runner):
    layers = [m for m in runner.model.modules() if isinstance(m, Attention)]
    assert len(layers) == runner.model.config.num_hidden_layers == runner.kv_cache.shape[0]
    assert all(l.kv_cache.data_ptr() == runner.kv_cache[i].data_ptr() for i, l in enumerate(layers))
    assert runner.captured_decode is not None  # GGUF blocks kept, float32


def test_decode_steps_equal_a_fresh_prefill_of_the_whole_sequence(runner):
    out = _generate(runner, {"a": (PROMPT, [9, 4, 17, 30])}, steps=6)["a"]
    assert len(out) == 7
    # each decoded token is what a new request prefilling prompt + earlier tokens would draw
    for i in range(1, len(out)):
        again = _step(runner, new=[_new("check", PROMPT + out[:i], [40, 41, 42, 43])])
        _step(runner, finished=["check"])
        assert again["check"] == out[i], i
    assert runner.requests == {}


def test_batched_requests_equal_each_alone_and_the_python_loop_equals_the_captured_step(runner):
    other = [1, 1204, 5248, 314, 253, 1789]
    alone_a = _generate(runner, {"a": (PROMPT, [1, 2, 3, 5])}, steps=5)["a"]
    alone_b = _generate(runner, {"b": (other, [6, 7, 8])}, steps=5)["b"]
    both = _generate(runner, {"a": (PROMPT, [10, 11, 12, 13]), "b": (other, [20, 21, 22])}, steps=5)
    assert both == {"a": alone_a, "b": alone_b}
    captured, runner.captured_decode = runner.captured_decode, None
    try:
        loop = _generate(runner, {"a": (PROMPT, [1, 2, 3, 5])}, steps=5)["a"]
    finally:
        runner.captured_decode = captured
    assert loop == alone_a


def test_prompt_logprobs_cover_every_prompt_position(runner):
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2)
    out = runner.execute_model(SchedulerOutput([_new("p", PROMPT, [50, 51], params)], [],
                                               {"p": len(PROMPT)}))
    lps = out.prompt_logprobs["p"]
    assert len(lps) == len(PROMPT) - 1
    assert [lp.token_ids[0] for lp in lps] == PROMPT[1:]  # each position scores the next token
    assert all(len(lp.token_ids) == 3 and lp.rank >= 1 for lp in lps)
    _step(runner, finished=["p"])


def test_prompt_logprobs_are_the_same_in_chunks_of_rows(runner, monkeypatch):
    """The runner computes prompt logprobs a few rows of logits at a time (memory); the
    numbers do not depend on where the chunks fall."""
    import pagedllm.worker.model_runner as model_runner

    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2)
    whole = runner.execute_model(SchedulerOutput([_new("w", PROMPT, [50, 51], params)], [],
                                                 {"w": len(PROMPT)})).prompt_logprobs["w"]
    _step(runner, finished=["w"])
    monkeypatch.setattr(model_runner, "PROMPT_LOGPROBS_ROWS", 2)
    chunked = runner.execute_model(SchedulerOutput([_new("c", PROMPT, [50, 51], params)], [],
                                                   {"c": len(PROMPT)})).prompt_logprobs["c"]
    _step(runner, finished=["c"])
    assert len(PROMPT) - 1 > 2 and len(chunked) == len(whole)
    for c, w in zip(chunked, whole):  # a matmul's rows may round differently by batch size
        assert c.token_ids[0] == w.token_ids[0]
        assert c.logprobs == pytest.approx(w.logprobs, abs=1e-4)


def test_persistent_buffers_are_not_reallocated(runner):
    ptrs = (runner.buffers.input_ids.data_ptr(), runner.buffers.block_table.data_ptr())
    _generate(runner, {"x": (PROMPT, [30, 31, 32])}, steps=3)
    assert (runner.buffers.input_ids.data_ptr(), runner.buffers.block_table.data_ptr()) == ptrs


def test_bitmask_rows_follow_the_sampling_rows_of_a_verify():
    """A constrained request's bitmask rows (after its last token, then after each draft) go
    to its sampling rows in order; a free request's rows allow every id."""
    from pagedllm.core.sched_output import GrammarBitmask
    from pagedllm.worker.model_runner import _bitmask_rows

    bitmask = torch.arange(4 * 2, dtype=torch.int32).view(4, 2)  # rows: a, c0, c1, c2
    grammar = GrammarBitmask(["a", "c", "c", "c"], bitmask)
    rows = _bitmask_rows(grammar, ["a", "b", "b", "c", "c", "c"], 64, torch.device("cpu"))
    assert rows.tolist() == [[0, 1], [-1, -1], [-1, -1], [2, 3], [4, 5], [6, 7]]
    with pytest.raises(RuntimeError, match="request c has 3 grammar bitmask rows for 2"):
        _bitmask_rows(grammar, ["a", "c", "c"], 64, torch.device("cpu"))
