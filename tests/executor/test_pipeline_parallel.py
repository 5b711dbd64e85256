"""Pipeline parallelism over local processes (pipeline_parallel_size=2, the "mp" executor):
greedy tokens equal the single process's on the shipped models, each stage reads only its own
tensors, the options are checked by name, and a killed rank fails the engine without a hang or
a leftover process."""
from __future__ import annotations

import gc
import json
import math
import os
import shutil
import signal
import struct
import time
from pathlib import Path

import psutil
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineConfig, ParallelConfig
from pagedllm.distributed.stage import PipelineStage
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.executor.abstract import WorkerDiedError, WorkerError
from pagedllm.executor.multiproc import MultiprocExecutor
from pagedllm.executor.rank_places import rank_places
from pagedllm.loader.gguf import weights as gguf_weights
from pagedllm.loader.checkpoint import resolve_checkpoint
from pagedllm.loader.gguf.header import gguf_header
from pagedllm.platforms.cpu import CpuPlatform
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.worker.model_loader import load_model
from rank_helpers import (DEADLINE_S, free_port, gone, kill_mid_generation,
                          one_process_scheduled_as_pp2, wait_healthy)

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "1, 2, 3, 4,",
]
GREEDY = SamplingParams(temperature=0, max_tokens=16)
ENGINE = dict(dtype="float32", max_model_len=512, max_num_seqs=8)


def _tokens(llm: LLM, prompts=PROMPTS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def _pp_equals_single(model: str, decode_path: str, monkeypatch=None, **engine) -> None:
    """Greedy tokens of PP=2 equal one process's, the same engine options otherwise; each
    stage's decode steps run `decode_path`. With monkeypatch, the one process schedules as
    PP=2 does (two batches in flight): where tokens depend on the schedule."""
    if monkeypatch is None:
        want = _tokens(LLM(model=model, **ENGINE, **engine))
    else:
        with one_process_scheduled_as_pp2(monkeypatch, model=model, **ENGINE, **engine) as one:
            want = _tokens(one)
        del one
    gc.collect()
    pp = LLM(model=model, pipeline_parallel_size=2, **ENGINE, **engine)
    try:
        executor = pp.llm_engine.engine_core.executor
        assert isinstance(executor, MultiprocExecutor)
        assert executor.decode_path().startswith(decode_path), executor.decode_path()
        assert _tokens(pp) == want
    finally:
        pp.llm_engine.shutdown()


# ---- options -------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, message", [
    (dict(distributed_executor_backend="threads"), "distributed_executor_backend must be one "
                                                   "of mp, ray, uni"),
    (dict(pipeline_parallel_size=2, distributed_executor_backend="uni"),
     "distributed_executor_backend='uni' runs one rank"),
    (dict(pipeline_parallel_size=0), "pipeline_parallel_size must be an int >= 1, got 0"),
    (dict(pipeline_parallel_size="2"), "pipeline_parallel_size must be an int >= 1, got '2'"),
    (dict(pipeline_parallel_size=True), "pipeline_parallel_size must be an int >= 1"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be an int >= 1, got 0"),
])
def test_parallel_options_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        EngineArgs(model="m", **kwargs)


def test_parallel_defaults_pick_the_executor():
    assert ParallelConfig().backend == "uni"
    assert ParallelConfig(pipeline_parallel_size=2).backend == "mp"
    assert ParallelConfig(tensor_parallel_size=1, distributed_executor_backend="mp").backend == "mp"


def test_more_stages_than_layers_is_refused_before_any_process_starts(smollm_gguf):
    before = psutil.Process().children(recursive=True)
    with pytest.raises(ValueError, match="pipeline_parallel_size=31 is larger than the model's "
                                         "30 layers"):
        LLM(model=str(smollm_gguf), pipeline_parallel_size=31, **ENGINE)
    assert psutil.Process().children(recursive=True) == before


# ---- each stage reads its own tensors only -------------------------------------------------
def test_a_stage_reads_only_its_own_tensors(smollm_gguf, monkeypatch):
    """The last stage of SmolLM2 (tied embeddings) reads layers 15-29, the final norm and the
    token embedding for its head, and nothing of layers 0-14."""
    read: list[str] = []
    copy = gguf_weights._copy_tensor
    monkeypatch.setattr(gguf_weights, "_copy_tensor",
                        lambda fh, info, *a: (read.append(info.name), copy(fh, info, *a))[1])
    ckpt = resolve_checkpoint(smollm_gguf)
    config = EngineConfig(model_path=str(smollm_gguf), arch=ckpt.arch, dtype=torch.float32,
                          platform=CpuPlatform(), quantization="none")
    stage = PipelineStage.of_rank(ckpt.arch.num_hidden_layers, 1, 2)
    model = load_model(config, stage)
    layers = {int(n.split(".")[1]) for n in read if n.startswith("blk.")}
    assert layers == set(range(15, 30))
    assert {n for n in read if not n.startswith("blk.")} == {"token_embd.weight",
                                                             "output_norm.weight"}
    params = model.checkpoint_params()
    assert not any(n.startswith(("model.layers.0.", "model.layers.14.", "model.embed_tokens"))
                   for n in params)
    assert "lm_head.weight" in params and "model.layers.15.input_layernorm.weight" in params


# ---- greedy tokens equal one process's -----------------------------------------------------
def test_smollm_gguf_pp2_equals_one_process(smollm_gguf):
    """SmolLM2 (llama, Q4_1 kept blocks, tied head on the last stage), batched."""
    _pp_equals_single(str(smollm_gguf), "the C++ decode stack")


def test_smollm_gguf_dequantized_pp2_equals_one_process(smollm_gguf):
    """SmolLM2's GGUF dequantized to float32 (quantization="none", the path that matches
    transformers): the head on the last stage loads the embedding matrix the first one holds."""
    _pp_equals_single(str(smollm_gguf), "the model's layer loop", quantization="none")


def test_qwen_gguf_pp2_equals_one_process_with_chunked_prompts(qwen_gguf, monkeypatch):
    """Qwen2.5-Coder-0.5B (qwen2, K-quants, its own output.weight), prompts in chunks of 16
    tokens so that steps mix prompt chunks and decodes on both stages. Its third prompt's
    first token is near a tie under K-quants: it changes with the chunking (one process, alone
    with 8-token chunks, picks what PP=2's two batches in flight pick), so the reference
    schedules as PP=2 does."""
    _pp_equals_single(str(qwen_gguf), "the C++ decode stack", monkeypatch,
                      max_num_batched_tokens=16)


def test_smollm_hf_dir_pp2_equals_one_process(smollm_hf_dir):
    """The float32 safetensors directory (sharded) of SmolLM2: the layer loop on both stages."""
    _pp_equals_single(str(smollm_hf_dir), "the model's layer loop")


@pytest.mark.parametrize("quantization", ["bf16", "int8_g128"])
def test_smollm_hf_dir_on_the_fast_path_pp2_equals_one_process(smollm_hf_dir, quantization):
    """The same directory on pagedllm's own kernels (bf16 matrices; int8 with one scale per 128
    values, x too): each stage's decode steps on the C++ stack, PP=2's tokens one process's."""
    _pp_equals_single(str(smollm_hf_dir), "the C++ decode stack", quantization=quantization)


def test_preemption_seeds_logprobs_and_grammars_under_pp2_equal_one_process(smollm_gguf,
                                                                          monkeypatch):
    """8 KV blocks and 16-token steps: requests are preempted and recomputed, prompts come in
    chunks; greedy and seeded tokens, logprobs, prompt logprobs and JSON-constrained outputs
    (the grammar bitmask travels in the SchedulerOutput to every rank) equal one process's
    under the same schedule and threads (two batches in flight, one thread: logprobs are
    compared exactly, and another batch or thread count moves them in the last bits)."""
    small = dict(dtype="float32", num_gpu_blocks_override=8, max_num_batched_tokens=16,
                 max_model_len=128)
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=1.0, seed=7, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=1),
              SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=40,
                             ignore_eos=True, repetition_penalty=1.2)]

    schema = {"type": "object", "properties": {"name": {"type": "string"},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"]}
    constrained = SamplingParams(temperature=0, max_tokens=30,
                                 structured_outputs=StructuredOutputsParams(json=schema))

    def run(llm: LLM) -> list:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        json_outs = llm.generate(["Give me a person as JSON:", "A JSON user:"], constrained,
                                 use_tqdm=False)
        return ([(o.outputs[0].token_ids, o.outputs[0].logprobs, o.prompt_logprobs)
                 for o in outs] + [o.outputs[0].text for o in json_outs])

    with one_process_scheduled_as_pp2(monkeypatch, model=str(smollm_gguf), **small) as single:
        want = run(single)
        assert single.llm_engine.engine_core.scheduler.num_preemptions > 0
    del single
    pp = LLM(model=str(smollm_gguf), pipeline_parallel_size=2, **small)
    try:
        got = run(pp)
        assert pp.llm_engine.engine_core.scheduler.num_preemptions > 0
    finally:
        pp.llm_engine.shutdown()
    assert [g[0] for g in got] == [w[0] for w in want]
    assert got == want
    assert all(set(json.loads(text)) >= {"name", "age"} for text in got[-2:])


def test_mp_backend_with_one_rank_equals_in_process(smollm_gguf):
    """distributed_executor_backend="mp" with one rank: the whole model in one worker process."""
    want = _tokens(LLM(model=str(smollm_gguf), **ENGINE), PROMPTS[:2])
    llm = LLM(model=str(smollm_gguf), distributed_executor_backend="mp", **ENGINE)
    try:
        assert len(llm.llm_engine.engine_core.executor.worker_pids) == 1
        assert _tokens(llm, PROMPTS[:2]) == want
    finally:
        llm.llm_engine.shutdown()


# ---- failure and shutdown ------------------------------------------------------------------
@pytest.mark.parametrize("killed", [0, 1])
def test_a_killed_rank_fails_generate_with_its_rank_named_and_leaves_no_process(smollm_gguf,
                                                                                killed):
    llm = LLM(model=str(smollm_gguf), pipeline_parallel_size=2, **ENGINE)
    executor = llm.llm_engine.engine_core.executor
    pids = executor.worker_pids
    assert len(pids) == 2 and not gone(pids)
    err = kill_mid_generation(llm, PROMPTS, pids[killed], max_tokens=400)
    assert isinstance(err, WorkerDiedError), err
    assert f"pipeline rank {killed}" in str(err) and f"pid {pids[killed]}" in str(err)
    assert "killed by signal 9" in str(err)
    deadline = time.monotonic() + 30
    while not gone(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone(pids), "a rank's process outlived the failure"
    # the engine stays failed, at once, with the same message
    started = time.monotonic()
    with pytest.raises(WorkerDiedError, match=f"pipeline rank {killed}"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    assert time.monotonic() - started < 5
    llm.llm_engine.shutdown()  # a second stop is harmless


def test_a_stopped_rank_fails_generate_within_the_step_deadline_and_is_killed(smollm_gguf):
    """SIGSTOP of stage 0 mid-generation: it stays alive and silent, so only the reply deadline
    (step_timeout=1: at most 4 s in the first steps, then ~1 s) sees it; the error names the
    stopped rank, and both ranks are killed (a stopped one would wait for SIGCONT forever)."""
    from pagedllm.executor.deadline import WorkerHungError

    llm = LLM(model=str(smollm_gguf), pipeline_parallel_size=2, step_timeout=1, **ENGINE)
    pids = llm.llm_engine.engine_core.executor.worker_pids
    try:
        started = time.monotonic()
        err = kill_mid_generation(llm, PROMPTS, pids[0], max_tokens=400, sig=signal.SIGSTOP)
        assert isinstance(err, WorkerHungError), err
        assert time.monotonic() - started < 20
        assert f"pipeline rank 0 (pid {pids[0]}) is stopped (SIGSTOP)" in str(err), err
        assert "has not answered for" in str(err)
        deadline = time.monotonic() + 15
        while not gone(pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert gone(pids), "a rank's process outlived the failure"
        with pytest.raises(WorkerHungError, match="pipeline rank 0"):
            llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    finally:
        for pid in pids:
            if not gone([pid]):
                os.kill(pid, signal.SIGKILL)
        llm.llm_engine.shutdown()


def test_a_rank_that_fails_to_load_fails_the_start_with_its_rank_named(tmp_path, smollm_gguf):
    """A NaN in layer 20's norm: rank 1 (layers 15-29) refuses it while loading; the engine
    reports that rank's error and no rank's process is left."""
    for file in smollm_gguf.parent.iterdir():  # the tokenizer files beside the GGUF
        if file.is_file() and file.suffix not in (".gguf", ".verified"):
            shutil.copy(file, tmp_path / file.name)
    norm = next(t for t in gguf_header(smollm_gguf)[1] if t.name == "blk.20.ffn_norm.weight")
    path = tmp_path / "nan.gguf"
    shutil.copy(smollm_gguf, path)
    with open(path, "r+b") as fh:
        fh.seek(norm.offset + 4 * 7)
        fh.write(struct.pack("<f", math.nan))
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(WorkerError, match=r"pipeline rank 1 failed: ModelFileError: model\.layers"
                                          r"\.20\.post_attention_layernorm\.weight holds 1 NaN"):
        LLM(model=str(path), pipeline_parallel_size=2, **ENGINE)
    left = {p.pid for p in psutil.Process().children(recursive=True)} - before
    assert gone(list(left))


def test_deleting_the_llm_stops_its_ranks(smollm_gguf):
    llm = LLM(model=str(smollm_gguf), pipeline_parallel_size=2, **ENGINE)
    pids = llm.llm_engine.engine_core.executor.worker_pids
    assert _tokens(llm, PROMPTS[:1])
    del llm
    gc.collect()
    deadline = time.monotonic() + 30
    while not gone(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone(pids)


def test_a_killed_rank_fails_every_open_stream_of_the_server_engine(smollm_gguf):
    """The server's engine (AsyncLLM): every request in flight ends with EngineDeadError naming
    the rank, and the engine keeps the error (what /health answers 503 on)."""
    import asyncio

    from pagedllm.engine.async_engine import AsyncLLM, EngineDeadError
    from pagedllm.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(EngineArgs(model=str(smollm_gguf),
                                                   pipeline_parallel_size=2, **ENGINE))
    pids = engine.engine_core.executor.worker_pids
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)

    async def main() -> list[BaseException]:
        llm = AsyncLLM(engine)
        try:
            streams = [llm.add_request(f"r{i}", p, long) for i, p in enumerate(PROMPTS)]
            await streams[0].__anext__()  # the engine is stepping
            os.kill(pids[1], signal.SIGKILL)
            errors = []
            for s in streams:
                try:
                    async for _ in s:
                        pass
                except EngineDeadError as err:
                    errors.append(err)
            assert isinstance(llm.error, WorkerDiedError)
            return errors
        finally:
            llm.shutdown()

    errors = asyncio.run(asyncio.wait_for(main(), DEADLINE_S))
    assert len(errors) == len(PROMPTS)
    assert all("pipeline rank 1" in str(e) for e in errors)
    assert gone(pids)


def test_serve_with_pp2_answers_and_stops_its_ranks(tmp_path):
    """`pagedllm serve -pp 2`: the flag reaches the engine, a completion comes back, and the
    ranks go when the server stops."""
    import subprocess
    import sys

    import httpx

    port = free_port()
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve",
                                 "smollm2-135m-instruct", "--port", str(port), "-pp", "2",
                                 "--max-model-len", "512"], stdout=out, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_healthy(proc, url, log)
            ranks = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
            assert len(ranks) == 2, log.read_text()[-3000:]
            body = httpx.post(f"{url}/v1/completions", timeout=60, json={
                "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0,
                "ignore_eos": True}).json()
            assert body["usage"]["completion_tokens"] == 8
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    assert gone(ranks)
    assert "pipeline parallel: rank 0" in log.read_text()


def test_ranks_import_the_engines_pagedllm_whatever_the_working_directory(tmp_path,
                                                                        smollm_gguf):
    """A script run from a directory that holds another `pagedllm` (a checkout, say): the
    ranks import the engine's, not the working directory's."""
    import subprocess
    import sys

    import pagedllm

    shadow = tmp_path / "cwd" / "pagedllm"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('the shadowing pagedllm')\n")
    script = tmp_path / "run.py"
    script.write_text(
        "from pagedllm import LLM, SamplingParams\n"
        f"llm = LLM(model={str(smollm_gguf)!r}, pipeline_parallel_size=2, max_model_len=256)\n"
        "out = llm.generate('Hi', SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)\n"
        "print('tokens', len(out[0].outputs[0].token_ids))\n")
    repo = str(Path(pagedllm.__file__).parents[1])
    proc = subprocess.run([sys.executable, str(script)], cwd=shadow.parent, text=True,
                          capture_output=True, timeout=DEADLINE_S,
                          env={**os.environ, "PYTHONPATH": repo})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tokens 4" in proc.stdout


def test_smollm_pp2_with_vllm_pp_layer_partition_equals_one_process(smollm_gguf, monkeypatch,
                                                                     caplog):
    """VLLM_PP_LAYER_PARTITION=20,10 on SmolLM2's 30 layers: the ranks hold 20 and 10 layers
    (each rank's KV block is its own layers'), the start-up log names the variable, and the
    greedy tokens equal one process's."""
    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
    want = _tokens(LLM(model=str(smollm_gguf), **ENGINE))
    gc.collect()
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "20,10")
    caplog.set_level("INFO", logger="pagedllm")
    pp = LLM(model=str(smollm_gguf), pipeline_parallel_size=2, **ENGINE)
    try:
        executor = pp.llm_engine.engine_core.executor
        assert [p.stage.layers for p in rank_places(executor.config)] == [range(0, 20),
                                                                         range(20, 30)]
        block = executor.collective_rpc("kv_block_bytes")
        assert block[0] == 2 * block[1], block
        assert "pipeline parallel (VLLM_PP_LAYER_PARTITION=20,10): rank 0" in caplog.text
        assert " layers 0-19, rank 1 " in caplog.text and " layers 20-29" in caplog.text
        assert _tokens(pp) == want
    finally:
        pp.llm_engine.shutdown()


def test_a_partition_for_another_size_is_refused_before_any_process_starts(smollm_gguf,
                                                                           monkeypatch):
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "16,8")
    with pytest.raises(ValueError, match=r"VLLM_PP_LAYER_PARTITION must be 2 comma-separated "
                                         r"layer counts >= 1.*30 layers.*which sums to 24"):
        LLM(model=str(smollm_gguf), pipeline_parallel_size=2, **ENGINE)
