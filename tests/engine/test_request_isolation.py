"""No request can stop the engine: bad fields are refused at the door, a request whose own step
fails finishes alone with "error", and only a fault in the shared step stops the engine.

The per-request failures are injected (monkeypatch) into the real engine on SmolLM2: no input
reaches them any more, and the engine must survive them if a new bug does."""
from __future__ import annotations

import asyncio

import pytest

from pagedllm import SamplingParams
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.async_engine import AsyncLLM, EngineDeadError, RequestFailedError
from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.engine.input_processor import InputProcessor
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.loader.checkpoint import resolve_checkpoint
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output.grammar import GrammarState

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
TRIGGER = "<<fail-here>>"  # a stop string that marks the request to fail


@pytest.fixture(scope="module")
def engine(smollm_gguf):
    return LLMEngine.from_engine_args(EngineArgs(model=str(smollm_gguf), dtype="float32",
                                                 max_num_seqs=4, max_model_len=256))


async def _collect(stream):
    last = None
    async for last in stream:
        pass
    return last


def _run(engine, coro_fn):
    async def main():
        llm = AsyncLLM(engine)
        try:
            return await coro_fn(llm)
        finally:
            llm.shutdown()
    return asyncio.run(main())


# ---- refused at the door -------------------------------------------------------------------
@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 2**64 - 1, 2**63])
def test_seed_outside_int64_is_refused(seed):
    with pytest.raises(ValueError, match=r"^seed must be in \["):
        SamplingParams(seed=seed, n=2)


def test_seed_at_the_edge_runs_with_n(engine):
    """The largest seed with n > 1: the children's seeds wrap instead of overflowing torch."""
    params = SamplingParams(seed=2**63 - 1, n=3, max_tokens=4, temperature=1.0)
    out = _run(engine, lambda llm: _collect(llm.add_request("edge", "Hello", params)))
    assert out.finished and [c.finish_reason for c in out.outputs] == ["length"] * 3


def test_text_that_tokenizes_to_nothing_is_refused(engine):
    # SmolLM2's tokenizer drops these control characters entirely
    assert engine.tokenizer.encode("\x04\x06\x13") == []
    with pytest.raises(ValueError, match="^prompt tokenizes to no tokens"):
        engine.add_request("empty", "\x04\x06\x13", GREEDY)
    assert not engine.has_unfinished_requests()


def test_max_tokens_beyond_the_context(engine):
    ids = engine.tokenizer.encode("Hello there")
    proc = engine.input_processor
    with pytest.raises(ValueError, match=r"^max_tokens \(or max_completion_tokens\) is too large: "
                       r"1000000000000\. This model's maximum context length is 256 tokens"):
        proc.process("big", "Hello there", SamplingParams(max_tokens=10**12),
                     max_tokens_must_fit=True)
    # offline (vLLM's LLM) it is capped instead
    (req,) = proc.process("big", "Hello there", SamplingParams(max_tokens=10**12)).requests
    assert req.max_tokens == 256 - len(ids)


def test_text_ids_are_checked_against_the_vocabulary(qwen_tokenizer):
    proc = InputProcessor(qwen_tokenizer, max_model_len=512, vocab_size=1000,
                          eos_token_ids=frozenset(), block_size=16, max_logprobs=20)
    with pytest.raises(ValueError, match=r"outside the model's vocabulary \[0, 1000\)"):
        proc.process("cjk", "你好，世界", GREEDY)


def test_a_tokenizer_larger_than_the_embedding_is_refused_at_load(smollm_gguf, qwen_gguf):
    qwen_tok = resolve_checkpoint(qwen_gguf).tokenizer_path
    with pytest.raises(ValueError, match=r"the tokenizer has 15\d{4} tokens but the model's "
                       r"embedding has 49152 rows"):
        LLMEngine.from_engine_args(EngineArgs(model=str(smollm_gguf), tokenizer=str(qwen_tok),
                                              dtype="float32", max_model_len=256))


def test_duplicate_request_id_is_refused(engine):
    async def go(llm):
        first = llm.add_request("dup", "Hello", GREEDY)
        with pytest.raises(ValueError, match="request_id 'dup' is already in use"):
            llm.add_request("dup", "Hello", GREEDY)
        return await _collect(first)
    assert _run(engine, go).finished


# ---- one request fails, the others go on ---------------------------------------------------
def _alone(engine, prompt: str) -> list[int]:
    return _run(engine, lambda llm: _collect(llm.add_request("alone", prompt, GREEDY))
                ).outputs[0].token_ids


def test_a_detokenizer_failure_fails_only_its_request(engine, monkeypatch):
    expected = _alone(engine, "The capital of France is")
    original = IncrementalDetokenizer.update

    def update(self, token_ids):
        if TRIGGER in self._stops:
            raise UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed")
        return original(self, token_ids)

    monkeypatch.setattr(IncrementalDetokenizer, "update", update)

    async def go(llm):
        bad = llm.add_request("bad", "Hello", SamplingParams(
            temperature=0, max_tokens=50, n=2, stop=[TRIGGER], ignore_eos=True))
        good = llm.add_request("good", "The capital of France is", GREEDY)
        with pytest.raises(RequestFailedError, match="request bad failed: UnicodeEncodeError"):
            await _collect(bad)
        out = await _collect(good)
        after = await _collect(llm.add_request("after", "The capital of France is", GREEDY))
        assert llm.error is None  # the engine thread lives
        return out, after, llm.stats()

    out, after, stats = _run(engine, go)
    assert out.outputs[0].token_ids == expected == after.outputs[0].token_ids
    assert stats.num_running == 0 and stats.kv_cache_usage == 0.0  # bad's blocks were freed


def test_a_grammar_failure_fails_only_its_request(engine, monkeypatch):
    expected = _alone(engine, "Once upon a time")
    original = GrammarState.fill_bitmask
    calls = {"n": 0}

    def fill_bitmask(self, bitmask, row):
        calls["n"] += 1
        if calls["n"] == 1:  # the first constrained request's first step
            raise RuntimeError("matcher state corrupted")
        return original(self, bitmask, row)

    monkeypatch.setattr(GrammarState, "fill_bitmask", fill_bitmask)
    choice = SamplingParams(temperature=0, max_tokens=8,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))

    async def go(llm):
        bad = llm.add_request("bad", "Answer yes or no:", choice)
        good = llm.add_request("good", "Once upon a time", GREEDY)
        with pytest.raises(RequestFailedError, match="structured output: RuntimeError"):
            await _collect(bad)
        out = await _collect(good)
        fine = await _collect(llm.add_request("fine", "Answer yes or no:", choice))
        return out, fine, llm.error

    out, fine, error = _run(engine, go)
    assert error is None and out.outputs[0].token_ids == expected
    assert fine.outputs[0].text in ("yes", "no")


def test_offline_failure_is_an_output_with_error(engine, monkeypatch):
    def update(self, token_ids):
        raise ValueError("cannot decode")

    monkeypatch.setattr(IncrementalDetokenizer, "update", update)
    engine.add_request("x", "Hello", GREEDY)
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
    (out,) = outs
    assert out.finished and out.error == "ValueError: cannot decode"
    assert out.outputs[0].finish_reason == "error"
    assert engine.kv_cache_usage == 0.0


# ---- a fault in the shared step stops the engine, and says so ------------------------------
def test_a_forward_failure_stops_the_engine(smollm_gguf, monkeypatch):
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(smollm_gguf), dtype="float32",
                                                   max_num_seqs=2, max_model_len=128))
    calls = {"n": 0}
    original = engine.engine_core.executor.execute_model

    def execute_model(sched):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("KV cache corrupted")
        return original(sched)

    monkeypatch.setattr(engine.engine_core.executor, "execute_model", execute_model)
    fatal = []

    async def go(llm):
        llm.on_fatal = fatal.append
        stream = llm.add_request("a", "Hello", SamplingParams(max_tokens=20, ignore_eos=True))
        with pytest.raises(EngineDeadError, match="KV cache corrupted"):
            await _collect(stream)
        with pytest.raises(EngineDeadError):
            llm.add_request("b", "Hello", GREEDY)
        return llm.error

    error = _run(engine, go)
    assert isinstance(error, RuntimeError) and fatal == [error]
