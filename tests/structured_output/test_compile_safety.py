"""Grammars compiled safely: the specs that crashed the process (in a subprocess), the caps
checked before compiling, the time limit, the bounded worker queue, the cache keyed by the
spec's hash and bounded in bytes, the first mask, the per-mask CPU limit."""
from __future__ import annotations

import ctypes
import json
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from pagedllm.config import StructuredOutputsConfig
from pagedllm.loader.checkpoint import resolve_checkpoint
from pagedllm.tokenizer.tokenizer import load_tokenizer
from pagedllm.sampling_params import StructuredOutputsParams as SO
from pagedllm.structured_output import compiler as compiler_module
from pagedllm.structured_output.bitmask import allocate_bitmask
from pagedllm.structured_output.compile_pool import STACK_BYTES, CompileBusyError, CompilePool
from pagedllm.structured_output.compiler import GrammarCompiler, estimated_bytes
from pagedllm.structured_output.grammar import MaskTooSlowError

REPO = Path(__file__).resolve().parents[2]


def chain(n: int) -> str:
    """A Lark grammar of an n-rule chain: start: r0, r0: r1, ..., r(n-1): "x"."""
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n - 1)) + f'r{n - 1}: "x"\n'


def ref_chain(n: int) -> dict:
    """A JSON schema whose $refs chain through n $defs."""
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n - 1)}
    defs[f"d{n - 1}"] = {"type": "string", "maxLength": 3}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def nested(depth: int) -> dict:
    """A schema of `depth` nested anyOf's (two levels each: the object and its list)."""
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"anyOf": [schema]}
    return schema


def properties(n: int) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)}}


@pytest.fixture(scope="module")
def tokenizer(smollm_gguf):
    return load_tokenizer(resolve_checkpoint(smollm_gguf).tokenizer_path)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, len(tokenizer))


# each of these killed the process (SIGSEGV: llguidance recursing on an 8 MB thread stack)
_CRASHERS = textwrap.dedent("""
    import json, sys
    from pagedllm import LLM, SamplingParams
    from pagedllm.sampling_params import StructuredOutputsParams as SO
    sys.path.insert(0, {tests!r})
    from test_compile_safety import chain, ref_chain
    specs = {{"chain3k": SO(grammar=chain(3000)), "chain10k": SO(grammar=chain(10000)),
             "refs10k": SO(json=ref_chain(10000))}}
    raised = dict(max_grammar_rules=20000, max_json_schema_nodes=20000,
                  max_grammar_bytes=10**7, grammar_compile_timeout=120)
    for caps in ({{}}, raised):
        llm = LLM({model!r}, max_model_len=256, **caps)
        for name, so in specs.items():
            params = SamplingParams(max_tokens=8, temperature=0, structured_outputs=so)
            try:
                text = llm.generate("Say x:", params, use_tqdm=False)[0].outputs[0].text
                print(json.dumps([name, bool(caps), "ok", text]), flush=True)
            except ValueError as err:
                print(json.dumps([name, bool(caps), "refused", str(err)]), flush=True)
        del llm
""")


def test_the_specs_that_crashed_the_process_are_refused_or_compile(smollm_gguf):
    """Offline LLM.generate, in a subprocess so that a crash fails this test, not the run: with
    the default caps each is a clear refusal; with the caps raised each compiles (on the
    large-stack worker) and generates."""
    script = _CRASHERS.format(tests=str(Path(__file__).parent), model=str(smollm_gguf))
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("[")]
    results = {(name, raised): (outcome, text) for name, raised, outcome, text in rows}
    assert len(results) == 6, proc.stdout
    assert all(results[(name, False)][0] == "refused" for name in ("chain3k", "chain10k",
                                                                    "refs10k"))
    assert "structured_outputs.grammar has 3001 rules" in results[("chain3k", False)][1]
    assert "(max_grammar_rules, --max-grammar-rules)" in results[("chain10k", False)][1]
    assert "(max_json_schema_nodes, --max-json-schema-nodes)" in results[("refs10k", False)][1]
    assert results[("chain3k", True)] == ("ok", "x")
    assert results[("chain10k", True)] == ("ok", "x")
    outcome, text = results[("refs10k", True)]
    assert outcome == "ok" and isinstance(json.loads(text), str), text


@pytest.mark.parametrize("params,message", [
    (SO(choice=[f"c{i}" for i in range(1001)]),
     "structured_outputs.choice has 1001 choices; at most 1000 are allowed "
     "(max_guided_choices, --max-guided-choices)"),
    (SO(regex="a" * (256 * 1024 + 1)),
     "structured_outputs.regex is 262145 bytes; at most 262144 are allowed "
     "(max_grammar_bytes, --max-grammar-bytes)"),
    (SO(grammar=chain(2000)), "structured_outputs.grammar has 2001 rules; at most 2000"),
    (SO(grammar="root ::= r0\n" + "".join(f"r{i} ::= \"a\"\n" for i in range(2001))),
     "has 2002 rules; at most 2000 are allowed (max_grammar_rules"),
    (SO(json=properties(2000), field_name="response_format"),
     "response_format has more objects and arrays; at most 2000 are allowed "
     "(max_json_schema_nodes, --max-json-schema-nodes)"),
    (SO(json=json.dumps(properties(2000))), "structured_outputs.json has more objects"),
    (SO(json=nested(100)), "structured_outputs.json nests deeper than 128 levels"),
])
def test_caps_are_checked_before_the_compiler_and_name_their_flag(compiler, params, message):
    started = time.perf_counter()
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        compiler.compile(params)
    assert time.perf_counter() - started < 1.0  # refused before anything was compiled


def test_specs_under_the_caps_compile(compiler):
    assert compiler.compile(SO(choice=[f"c{i}" for i in range(1000)])) is not None
    assert compiler.compile(SO(json=properties(400))) is not None
    assert compiler.compile(SO(grammar=chain(1999))) is not None


def test_a_compile_over_the_time_limit_is_refused_naming_the_field(tokenizer):
    slow = GrammarCompiler(tokenizer, len(tokenizer),
                           StructuredOutputsConfig(grammar_compile_timeout=0.05))
    slow.warm_up()
    with pytest.raises(ValueError, match=r"response_format did not compile within 0.05 s "
                                         r"\(grammar_compile_timeout, --grammar-compile-timeout\)"):
        slow.compile(SO(json=properties(1500), field_name="response_format"))
    deadline = time.monotonic() + 60  # the compile goes on on its worker; its result is not kept
    while slow._pool.in_flight and time.monotonic() < deadline:
        time.sleep(0.05)
    assert slow.cache_len == 0


def test_the_pool_runs_on_large_stacks_and_refuses_beyond_its_queue():
    pool = CompilePool(num_workers=1, max_queued=1)
    release = threading.Event()
    first = pool.submit(lambda: release.wait(10) and threading.stack_size())
    queued = pool.submit(lambda: "second")
    with pytest.raises(CompileBusyError, match="the grammar compiler is busy"):
        pool.submit(lambda: "third")
    assert pool.in_flight == 2
    release.set()
    assert queued.result(10) == "second" and first.done()
    deadline = time.monotonic() + 5
    while pool.in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool.submit(lambda: "again").result(10) == "again"  # room once they finished
    assert threading.stack_size() == 0  # the process-wide setting was put back


def _own_stack_bytes() -> int:
    """The calling thread's stack size (glibc's pthread_getattr_np)."""
    libc = ctypes.CDLL(None)
    libc.pthread_self.restype = ctypes.c_ulong
    attr = ctypes.create_string_buffer(128)  # pthread_attr_t is 56 bytes on x86-64
    assert libc.pthread_getattr_np(ctypes.c_ulong(libc.pthread_self()), attr) == 0
    base, size = ctypes.c_void_p(), ctypes.c_size_t()
    libc.pthread_attr_getstack(attr, ctypes.byref(base), ctypes.byref(size))
    libc.pthread_attr_destroy(attr)
    return size.value


def test_the_worker_thread_has_the_large_stack():
    """threading.stack_size is read when a thread starts: the worker has the large one, a
    thread started afterwards the ordinary one."""
    pool = CompilePool(num_workers=1, max_queued=0)
    assert pool.submit(_own_stack_bytes).result(10) >= STACK_BYTES
    other = []
    thread = threading.Thread(target=lambda: other.append(_own_stack_bytes()))
    thread.start()
    thread.join()
    assert other[0] < STACK_BYTES


def test_the_cache_is_keyed_before_conversion_and_bounded_in_bytes(tokenizer, monkeypatch):
    small = StructuredOutputsConfig(grammar_cache_bytes=3 * estimated_bytes("x" * 2000))
    cache = GrammarCompiler(tokenizer, len(tokenizer), small)
    conversions = []
    real = compiler_module.grammar_text
    monkeypatch.setattr(compiler_module, "grammar_text",
                        lambda params: conversions.append(params.kind) or real(params))
    first = cache.compile(SO(json=properties(3)))
    assert cache.compile(SO(json=json.loads(json.dumps(properties(3))))) is first
    assert cache.compile(SO(json=json.dumps(properties(3)))) is not first  # text: its own key
    assert conversions == ["json", "json"]  # a hit converts nothing
    for n in range(4, 12):
        cache.compile(SO(json=properties(n)))
    assert cache.cache_bytes <= small.grammar_cache_bytes and cache.cache_len < 10
    assert cache.cache_bytes == sum(g.num_bytes for g in cache._cache.values())


def test_the_first_mask_is_the_matchers_and_later_masks_are_cpu_limited(tokenizer):
    strict = GrammarCompiler(tokenizer, len(tokenizer),
                             StructuredOutputsConfig(max_grammar_mask_ms=1e-6))
    grammar = strict.compile(SO(choice=["yes", "no"]))
    state = grammar.new_state()
    computed = allocate_bitmask(1, len(tokenizer))
    grammar._prototype.deep_copy().unsafe_compute_mask_ptr(computed[0].data_ptr(),
                                                           computed[0].numel() * 4)
    bitmask = allocate_bitmask(1, len(tokenizer))
    state.fill_bitmask(bitmask, 0)  # the first step: the compile's mask, not recomputed
    assert bitmask.equal(computed)
    assert state.accept(tokenizer.encode("y")[0])
    with pytest.raises(MaskTooSlowError, match=r"more than max_grammar_mask_ms=1e-06 "
                                               r"\(--max-grammar-mask-ms\)"):
        state.fill_bitmask(bitmask, 0)
    with pytest.raises(MaskTooSlowError):  # and every later step, without computing
        state.fill_bitmask(allocate_bitmask(1, len(tokenizer)), 0)


def test_the_mask_budget_is_per_request_and_per_step(tokenizer):
    """n samples share one budget: their masks of one step add up; a new step starts afresh."""
    grammar = GrammarCompiler(tokenizer, len(tokenizer),
                              StructuredOutputsConfig(max_grammar_mask_ms=1e3)).compile(
        SO(regex="[a-z]+"))
    budget = grammar.new_budget()
    states = [grammar.new_state(budget) for _ in range(3)]
    token = tokenizer.encode("ab")[0]
    for state in states:
        assert state.accept(token)
    for _ in range(2):  # two steps
        bitmask = allocate_bitmask(3, len(tokenizer))
        for row, state in enumerate(states):
            state.fill_bitmask(bitmask, row)
        assert 0 < budget._spent < 1.0 and budget._step() is bitmask
    budget.limit_s = budget._spent * 0.99  # as if this step's three masks cost more than allowed
    with pytest.raises(MaskTooSlowError, match="in one step"):
        budget.charge(bitmask, budget._spent * 0.02)
    with pytest.raises(MaskTooSlowError):
        states[0].fill_bitmask(allocate_bitmask(3, len(tokenizer)), 0)


def test_draft_masks_stop_at_the_budget_without_failing_the_request(tokenizer):
    """Speculative decoding: a draft's mask is computed only while the step's masks are under
    the budget; past it the drafts stop (one mask here), the request goes on."""
    grammar = GrammarCompiler(tokenizer, len(tokenizer),
                              StructuredOutputsConfig(max_grammar_mask_ms=1e-6)).compile(
        SO(regex="[a-z]+( [a-z]+){3}"))
    state = grammar.new_state()
    assert state.accept(tokenizer.encode("to")[0])
    drafts = tokenizer.encode(" be or not")
    assert state.check_drafts(drafts) == 3  # without masks: no budget spent
    bitmask = allocate_bitmask(4, len(tokenizer))
    assert state.check_drafts(drafts, bitmask, 0) == 1
    assert state._budget._over is None and state._budget._spent == 0.0
    assert state.check_drafts(drafts, bitmask, 0) == 0  # the same step: no room left
    assert state.check_drafts(drafts, allocate_bitmask(4, len(tokenizer)), 0) == 1  # next step
    assert all(state.accept(t) for t in drafts)


def test_allowed_ids_are_checked_against_the_first_mask(compiler, tokenizer):
    grammar = compiler.compile(SO(choice=["yes", "no"]))
    assert grammar.allows_any([tokenizer.encode("yes")[0]])
    assert not grammar.allows_any([tokenizer.encode(" zebra")[0], len(tokenizer) + 5])
