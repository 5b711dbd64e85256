"""Constraint checks, grammar compilation (errors name the field; the cache), and bitmasks."""
from __future__ import annotations

import re

import pytest
import torch

from pagedllm.loader.checkpoint import resolve_checkpoint
from pagedllm.tokenizer.tokenizer import load_tokenizer
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams as SO
from pagedllm.structured_output.bitmask import allocate_bitmask, apply_bitmask_, bitmask_to_bool
from pagedllm.structured_output.compiler import GrammarCompiler


@pytest.fixture(scope="module")
def tokenizer(smollm_gguf):
    return load_tokenizer(resolve_checkpoint(smollm_gguf).tokenizer_path)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, len(tokenizer), cache_size=3)


@pytest.mark.parametrize("kwargs,message", [
    ({}, "must set exactly one of json, regex, choice, grammar, json_object; got none"),
    ({"regex": "a", "choice": ["b"]}, "got regex, choice"),
    ({"regex": "  "}, "structured_outputs.regex must be a non-empty string"),
    ({"grammar": ""}, "structured_outputs.grammar must be a non-empty string"),
    ({"choice": []}, "structured_outputs.choice must be a non-empty list"),
    ({"choice": ["a", ""]}, "structured_outputs.choice must be a non-empty list"),
    ({"json": 3}, "structured_outputs.json must be a JSON schema"),
    ({"json_object": "yes"}, "structured_outputs.json_object must be true"),
    ({"regex": "a", "whitespace_pattern": " "}, "whitespace_pattern applies to json and"),
    ({"json": {}, "structural_tag": "x"}, "structural_tag is not supported"),
    ({"guided": 1}, None),
])
def test_constraint_checks_name_the_field(kwargs, message):
    if message is None:
        with pytest.raises(TypeError):
            SO(**kwargs)
        return
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        SO(**kwargs)


def test_sampling_params_takes_only_structured_outputs_params():
    assert SamplingParams(structured_outputs=SO(regex="a+")).structured_outputs.kind == "regex"
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"regex": "a"})


@pytest.mark.parametrize("params,message", [
    (SO(regex="("), "(?s)structured_outputs.regex is not a valid regex: .*unclosed group"),
    (SO(json={"type": "nonsense"}), "structured_outputs.json is not a valid json: .*nonsense"),
    (SO(json="{not json"), "structured_outputs.json is not a valid json"),
    (SO(json="[1, 2]"), "structured_outputs.json is not a valid json: a JSON schema must be"),
    (SO(grammar="root ::= ("), "structured_outputs.grammar is not a valid grammar"),
    (SO(regex="(", field_name="guided_regex"), "guided_regex is not a valid regex"),
])
def test_invalid_specs_are_value_errors_naming_the_field(compiler, params, message):
    with pytest.raises(ValueError, match=message):
        compiler.compile(params)


# SmolLM2's byte-level BPE has no token with the byte 0xF2 (the lead byte of U+80000-U+BFFFF)
# nor 0x04: a constraint that needs one would make the grammar engine force a byte the
# tokenizer drops, and fail mid-request (a fuzzed guided_choice did: a 500). Each escaped form
# below failed so before it was read (the regexes and grammars after their first "a")
NEEDS = "; every output the constraint allows needs it"
BYTE_04 = ("'\\x04' (U+0004), which this model's vocabulary cannot write: no token holds the "
           "byte 0x04")


@pytest.mark.parametrize("params,message", [
    (SO(choice=["ok", "\U000b7105\u00a2"]), "structured_outputs.choice holds '\\U000b7105' "
     "(U+B7105), which this model's vocabulary cannot write: no token holds the byte 0xF2"),
    (SO(regex="a\x04b", field_name="guided_regex"), "guided_regex holds " + BYTE_04 + NEEDS),
    (SO(json={"const": "\U000b7105"}), "structured_outputs.json holds '\\U000b7105'"),
    (SO(grammar='root ::= "\U000b7105"'), "structured_outputs.grammar holds '\\U000b7105'"),
    # the escapes Rust's regex (llguidance's) takes, in a regex
    (SO(regex=r"a\x04b"), "regex holds " + BYTE_04 + NEEDS),
    (SO(regex=r"a\x{4}b"), "regex holds '\\x04' (U+0004)"),
    (SO(regex=r"a\u0004b"), "regex holds '\\x04' (U+0004)"),
    (SO(regex=r"a\u{4}b"), "regex holds '\\x04' (U+0004)"),
    (SO(regex=r"a\U{4}b"), "regex holds '\\x04' (U+0004)"),
    (SO(regex=r"a\U000b7105b"), "regex holds '\\U000b7105' (U+B7105), which this model's "
     "vocabulary cannot write: no token holds the byte 0xF2" + NEEDS),
    (SO(regex=r"a\x{b7105}b"), "regex holds '\\U000b7105' (U+B7105)"),
    # a class or alternation with no writable choice, a required repeat, a case-blind group
    (SO(regex=r"a[\x04\x06]b"), "regex holds '\\x04' (U+0004)"),
    (SO(regex=r"a(\x06|\x04)b"), "regex holds '\\x06' (U+0006)"),
    (SO(regex=r"a[\x{80000}-\x{bffff}]b"), "regex holds '\\U00080000' (U+80000)"),
    (SO(regex=r"a\x04+b"), "regex holds '\\x04' (U+0004)"),  # was llguidance's NoExtensionBias
    (SO(regex=r"(?i:a\x04)|b\x{4}"), "regex holds '\\x04' (U+0004)"),
    (SO(regex=r"\p{L}+\x04"), "regex holds '\\x04' (U+0004)"),
    # a Lark grammar's string escapes (JSON's and \xHH) and /regex/ terminals; GBNF's
    (SO(grammar=r'start: "a" "\x04" "b"'), "grammar holds " + BYTE_04 + NEEDS),
    (SO(grammar=r'start: "a" "\u0004"i "b"'), "grammar holds '\\x04' (U+0004)"),
    (SO(grammar='start: "a" /[\\x04\\x06]/ "b"'), "grammar holds '\\x04' (U+0004)"),
    (SO(grammar='start: "a" x\nx: "\\x04" | y+\ny: "b" "\\x06"'),
     "grammar holds '\\x04' (U+0004)"),
    (SO(grammar=r'root ::= "a" [\x04] "b"'), "grammar holds '\\x04' (U+0004)"),
    (SO(grammar='start: "a" %json {"type": "string", "pattern": "^\\\\U000b7105$"}'),
     "grammar holds '\\U000b7105' (U+B7105)"),
    # a JSON schema's pattern (a control character would be written as a \u escape)
    (SO(json={"type": "string", "pattern": r"^a\x{b7105}b$"}),
     "structured_outputs.json holds '\\U000b7105' (U+B7105), which this model's "
     "vocabulary cannot write: no token holds the byte 0xF2" + NEEDS),
    (SO(json='{"type": "string", "pattern": "^a[\\\\U000b7105\\\\U000b7106]"}'),
     "structured_outputs.json holds '\\U000b7105' (U+B7105)"),
])
def test_characters_the_vocabulary_cannot_write_are_refused_by_name(compiler, params, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        compiler.compile(params)


@pytest.mark.parametrize("params,text", [
    (SO(regex=r"a(\x04|c)b"), "acb"),  # a writable choice is left
    (SO(regex=r"a[\x00-\x7f]b"), "arb"),
    (SO(regex=r"a\x04?b|\x06"), "ab"),
    (SO(regex=r"a.\xF2\x{e9}"), "a\u4e2d\u00f2\u00e9"),  # \xF2 is U+00F2, not the byte
    (SO(regex="caf\u00e9 \u00a2+"), "caf\u00e9 \u00a2"),
    (SO(regex=r"a\004"), None),  # an escape Rust refuses: llguidance's own error, not ours
    (SO(grammar=r'start: "a" | "\x04" | /\x06/'), "a"),
    (SO(grammar='start: "a" x?\nx: "\U000b7105"'), "a"),
    (SO(grammar=r'root ::= "a" [\x04]* "b"'), "ab"),
    (SO(json={"type": "string", "pattern": r"^a\x04b$"}), '"a\\u0004b"'),
    (SO(json={"type": "string", "const": "a\x04b"}), '"a\\u0004b"'),
    (SO(json={"type": "string", "pattern": r"^a(\U000b7105|c)b$"}), '"acb"'),
])
def test_constraints_a_writable_output_satisfies_are_kept(compiler, tokenizer, params, text):
    if text is None:
        with pytest.raises(ValueError, match="(?s)is not a valid regex: .*backreference"):
            compiler.compile(params)
        return
    state = compiler.compile(params).new_state()
    assert all(state.accept(t) for t in tokenizer.encode(text)) and state.error is None
    other = compiler.compile(params).new_state()  # and it still constrains: "x" is refused
    assert not other.accept(tokenizer.encode("x")[0])


def test_non_ascii_characters_the_vocabulary_writes_are_kept(compiler, tokenizer):
    state = compiler.compile(SO(choice=["caf\u00e9 \u00a2", "\u4e2d"])).new_state()
    assert all(state.accept(t) for t in tokenizer.encode("\u4e2d")) and state.error is None
    assert state.is_terminated


def test_compiled_grammars_are_cached_by_spec_and_bounded(compiler):
    first = compiler.compile(SO(regex="[ab]+"))
    assert compiler.compile(SO(regex="[ab]+")) is first  # same spec: the cached grammar
    assert compiler.compile(SO(regex="[ab]+", field_name="guided_regex")) is first
    for spec in ("x+", "y+", "z+"):
        compiler.compile(SO(regex=spec))
    assert compiler.cache_len == 3  # the least recently used one was dropped
    assert compiler.compile(SO(regex="[ab]+")) is not first


def test_grammar_state_masks_follows_tokens_and_terminates(compiler, tokenizer):
    vocab = len(tokenizer)
    state = compiler.compile(SO(choice=["yes", "no"])).new_state()
    bitmask = allocate_bitmask(1, vocab)
    state.fill_bitmask(bitmask, 0)
    allowed = bitmask_to_bool(bitmask, vocab)[0].nonzero().flatten().tolist()
    texts = {tokenizer.decode([t]) for t in allowed}
    assert allowed and all("yes".startswith(t) or "no".startswith(t) for t in texts), texts
    for token in tokenizer.encode("yes"):
        assert state.accept(token)
    assert state.is_terminated and state.error is None
    other = compiler.compile(SO(choice=["yes", "no"])).new_state()  # states are independent
    assert not other.is_terminated


def test_json_options_compact_whitespace_and_closed_objects(compiler, tokenizer):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}

    def accepts(params: SO, text: str) -> bool:
        state = compiler.compile(params).new_state()
        return all(state.accept(t) for t in tokenizer.encode(text)) and state.error is None

    assert accepts(SO(json=schema), '{ "a" :  1 }')
    assert not accepts(SO(json=schema, disable_any_whitespace=True), '{ "a": 1}')
    assert accepts(SO(json=schema, disable_any_whitespace=True), '{"a":1}')
    assert accepts(SO(json=schema), '{"b": 2}')  # open objects take other keys
    assert not accepts(SO(json=schema, disable_additional_properties=True), '{"b": 2}')
    assert not accepts(SO(json_object=True, whitespace_pattern="[ ]?"), '{\n"b": 2}')


def _mask(state, vocab: int) -> torch.Tensor:
    bitmask = allocate_bitmask(1, vocab)
    state.fill_bitmask(bitmask, 0)
    return bitmask[0]


def test_drafts_are_cut_at_the_first_refused_and_the_state_is_unchanged(compiler, tokenizer):
    """Speculative decoding: drafts checked against the grammar are kept up to the first one it
    refuses; row j after the request's own row is the mask after the first j drafts; the
    matcher is rolled back, so the state masks and accepts as before the check."""
    vocab, spec = len(tokenizer), SO(regex="[a-z]+( [a-z]+){2}")  # three words
    state = compiler.compile(spec).new_state()
    assert state.accept(tokenizer.encode("to")[0])
    before = _mask(state, vocab)
    drafts = tokenizer.encode(" be or not")  # " not" would be a fourth word
    assert len(drafts) == 3 and state.check_drafts(drafts) == 2
    assert state.check_drafts(tokenizer.encode("!") + drafts) == 0
    assert _mask(state, vocab).equal(before)
    bitmask = allocate_bitmask(1 + len(drafts), vocab)
    state.fill_bitmask(bitmask, 0)
    assert state.check_drafts(drafts, bitmask, 0) == 2
    reference = compiler.compile(spec).new_state()  # the same tokens, accepted one by one
    for j, token in enumerate(tokenizer.encode("to") + drafts[:2]):
        assert reference.accept(token)
        assert bitmask[j].equal(before if j == 0 else _mask(reference, vocab))
    assert bitmask_to_bool(bitmask, vocab)[1, drafts[1]]
    assert not bitmask_to_bool(bitmask, vocab)[2, drafts[2]]
    assert (bitmask[3] == -1).all()  # no row after a refused draft
    assert _mask(state, vocab).equal(before)
    assert all(state.accept(t) for t in drafts[:2]) and not state.is_terminated


def test_drafts_stop_after_the_one_that_completes_the_grammar(compiler, tokenizer):
    state = compiler.compile(SO(choice=["yes", "no"])).new_state()  # at its start (first mask)
    eos = tokenizer.eos_token_id
    bitmask = allocate_bitmask(3, len(tokenizer))
    state.fill_bitmask(bitmask, 0)
    assert state.check_drafts(tokenizer.encode("yes") + [eos], bitmask, 0) == 1
    assert bitmask_to_bool(bitmask, len(tokenizer))[1].nonzero().flatten().tolist() == [eos]
    assert not state.is_terminated and state.check_drafts(tokenizer.encode(" no")) == 0
    assert state.accept(tokenizer.encode("yes")[0]) and state.is_terminated
    assert state.check_drafts([eos]) == 0  # nothing is drafted after the end


def test_a_thinking_request_drafts_up_to_its_end_tag(compiler, tokenizer):
    """Under a reasoning gate: while thinking every id is allowed, so drafts are kept up to
    the end tag (its answer's grammar is not drafted into); answering, the grammar checks."""
    from pagedllm.structured_output.reasoning import (Phase, PhaseTracker, ReasoningGate,
                                                      ReasoningTokens)

    start, end = tokenizer.encode("{")[0], tokenizer.encode("}")[0]  # as the tags here
    tags = ReasoningTokens("qwen3", "{", "}", start, end, True)
    words = tokenizer.encode(" be or not")
    inner = compiler.compile(SO(regex="[a-z]+( [a-z]+){2}")).new_state()
    gate = ReasoningGate(inner, PhaseTracker(tags, Phase.THINKING))
    bitmask = allocate_bitmask(4, len(tokenizer))
    bitmask[1:] = 0
    assert gate.check_drafts(words[:2] + [end] + words[2:], bitmask, 0) == 2
    assert (bitmask[1:3] == -1).all() and (bitmask[3] == 0).all()
    assert ReasoningGate(inner, PhaseTracker(tags, Phase.OPENING)).check_drafts(words) == 0
    answering = ReasoningGate(inner, PhaseTracker(tags, Phase.ANSWER))
    assert answering.accept(tokenizer.encode("to")[0])
    assert answering.check_drafts(words) == 2 and gate.tracker.phase is Phase.THINKING


def test_bitmask_bits_and_apply():
    bitmask = allocate_bitmask(2, 70)  # 3 words a row
    assert bitmask.shape == (2, 3) and bitmask_to_bool(bitmask, 70).all()
    bitmask[0] = 0
    bitmask[0, 1] = 1 << 5  # only id 32 + 5
    logits = torch.randn(2, 70)
    before = logits.clone()
    apply_bitmask_(logits, bitmask)
    assert torch.isinf(logits[0]).sum() == 69 and logits[0, 37] == before[0, 37]
    assert torch.equal(logits[1], before[1])


_PROBES = ["Hello, world!", "  two  spaces\tand\ttabs\n", "\u00e9\u4e2d\U0001f600 {\"a\": [1, 2]}",
           "<|im_end|> not special here", "x" * 50]


def test_the_vocabulary_view_is_the_one_llguidance_hf_builds(tokenizer):
    """pagedllm builds llguidance's tokenizer from the Rust backend's JSON, not through
    llguidance.hf, which takes only a transformers tokenizer: the same view either way."""
    from llguidance.hf import from_tokenizer

    from pagedllm.tokenizer.hf_tokenizer import to_transformers

    reference = from_tokenizer(to_transformers(tokenizer), n_vocab=len(tokenizer))
    ours = GrammarCompiler(tokenizer, len(tokenizer))._tokenizer()
    assert (ours.vocab_size, ours.eos_token) == (reference.vocab_size, reference.eos_token)
    for text in _PROBES:
        assert ours.tokenize_str(text) == reference.tokenize_str(text)
    assert all(ours.decode_bytes([i]) == reference.decode_bytes([i])
               for i in range(0, len(tokenizer), 97))


def test_the_warm_up_waits_for_an_idle_engine(smollm_gguf):
    """The server's grammar warm-up holds the GIL for up to a second, so it runs only after the
    engine has been idle for the delay, never while a request is in flight."""
    import time

    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.engine.async_engine import AsyncLLM
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.sampling_params import SamplingParams

    engine = LLMEngine.from_engine_args(EngineArgs.from_kwargs(str(smollm_gguf), max_model_len=256))
    async_llm = AsyncLLM(engine)
    try:
        grammars = engine.input_processor.grammars
        engine.add_request("busy", "Count to a hundred:", SamplingParams(max_tokens=64,
                                                                          ignore_eos=True))
        tokenizing = [False]
        async_llm.warm_up_grammars(delay=0.2, busy=lambda: tokenizing[0])
        time.sleep(2.0)  # well past the delay and a warm-up's own time
        assert not grammars.warm  # a request is in flight (the engine thread is not stepping)
        tokenizing[0] = True
        engine.abort_request(["busy"])
        time.sleep(1.5)
        assert not grammars.warm  # the server is tokenizing a prompt
        tokenizing[0] = False
        deadline = time.monotonic() + 10
        while not grammars.warm and time.monotonic() < deadline:
            time.sleep(0.05)
        assert grammars.warm
    finally:
        async_llm.shutdown()
