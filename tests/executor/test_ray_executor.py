"""The Ray executor (distributed_executor_backend="ray") on a local Ray cluster of two nodes
(ray.cluster_utils.Cluster, one CPU each) that the engine joins through RAY_ADDRESS: greedy
tokens with pipeline_parallel_size=2 equal one process's, and with tensor_parallel_size=2 equal
the mp executor's and one process's, one rank on each node; a killed actor fails generate with
its rank named, and the engine leaves nothing behind in the cluster; a cluster without room is
refused by name; without Ray the option is one line saying how to install it. Four ranks
(tensor_parallel_size=2 x pipeline_parallel_size=2) run on the engine's own local Ray instead:
the two-node cluster has a CPU bundle for two.

TP runs on Qwen2.5-Coder-0.5B's HF directory in float32, as tests/executor/test_tensor_parallel.py
does (SmolLM2's 9 heads do not split over 2 ranks)."""
from __future__ import annotations

import math
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import ray
from ray.cluster_utils import Cluster

import pagedllm
from pagedllm import LLM, SamplingParams
from pagedllm.executor import ray_executor
from pagedllm.executor.abstract import WorkerDiedError, WorkerError
from pagedllm.executor.multiproc import MultiprocExecutor
from pagedllm.executor.ray_executor import RayExecutor
from pagedllm.loader.gguf.header import gguf_header
from rank_helpers import DEADLINE_S, free_port, gone, kill_mid_generation, wait_healthy

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
]
GREEDY = SamplingParams(temperature=0, max_tokens=12)
TP_GREEDY = SamplingParams(temperature=0, max_tokens=12, logprobs=20)
# TP's all-reduce sums o_proj's and down_proj's reduction in another order than one process
# (see test_tensor_parallel.py): the first position's log-probabilities agree within this
LOGPROB_TOL = 1e-3
ENGINE = dict(dtype="float32", max_model_len=256, max_num_seqs=4)
NODE = dict(num_cpus=1, object_store_memory=100 * 2**20)


@pytest.fixture(scope="module", autouse=True)
def ray_env():
    """Ray's settings for these tests, in this process and the ones it starts: no usage
    report, and token authentication off. A new local Ray turns it on by default, writing a
    token to ~/.ray and RAY_AUTH_MODE=token into this process's environment, which a cluster
    started before it would then refuse; these clusters live a minute on this machine."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAY_AUTH_MODE", "disabled")
        patch.setenv("RAY_USAGE_STATS_ENABLED", "0")
        yield


@pytest.fixture(scope="module")
def ray_cluster(ray_env):
    """Two Ray nodes of one CPU each on this machine, the head without a dashboard; stopped
    (their processes only) after the module's tests."""
    cluster = Cluster(initialize_head=True, head_node_args=dict(NODE, include_dashboard=False))
    try:
        cluster.add_node(**NODE)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="module")
def smollm_single(smollm_gguf) -> dict[int, list[list[int]]]:
    """One process's greedy tokens of SmolLM2: the first n of PROMPTS run together, for n = 3
    and 1; one engine for every test that compares with it."""
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
        single = LLM(model=str(smollm_gguf), **ENGINE)
        try:
            return {n: _tokens(single, PROMPTS[:n]) for n in (len(PROMPTS), 1)}
        finally:
            single.llm_engine.shutdown()


@pytest.fixture
def ray_address(ray_cluster, monkeypatch):
    """RAY_ADDRESS pointing at the two-node cluster, as `ray start --address` users set it."""
    monkeypatch.setenv("RAY_ADDRESS", ray_cluster.address)
    yield ray_cluster.address
    if ray.is_initialized():  # a test that failed half-way leaves no connection behind
        ray.shutdown()


def _tokens(llm: LLM, prompts=PROMPTS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def _wait_gone(pids: list[int], timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while not gone(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return gone(pids)


def _cluster_is_free(address: str) -> None:
    """No placement group left and every CPU free again, seen from a fresh connection."""
    ray.init(address=address)
    try:
        groups = ray.util.placement_group_table().values()
        assert all(g["state"] == "REMOVED" for g in groups), list(groups)
        deadline = time.monotonic() + 30
        while ray.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ray.available_resources().get("CPU", 0) == 2, ray.available_resources()
    finally:
        ray.shutdown()


def test_pp2_on_two_ray_nodes_equals_one_process(smollm_gguf, smollm_single, ray_address):
    """SmolLM2 GGUF in float32, one stage per node: the same greedy tokens as one process, with
    two batches in flight; the actors import this checkout's pagedllm; shutdown frees the
    cluster."""
    want = smollm_single[len(PROMPTS)]
    llm = LLM(model=str(smollm_gguf), pipeline_parallel_size=2,
              distributed_executor_backend="ray", **ENGINE)
    try:
        executor = llm.llm_engine.engine_core.executor
        assert isinstance(executor, RayExecutor)
        places = executor.worker_places
        assert ray.get_runtime_context().gcs_address == ray_address
        assert [p.package_dir for p in places] == [str(Path(pagedllm.__file__).parent)] * 2
        node_of = ray.util.placement_group_table(executor._cluster.group)["bundles_to_node_id"]
        assert len(set(node_of.values())) == 2, "STRICT_SPREAD: one rank on each node"
        assert executor.decode_path().startswith("the C++ decode stack")
        assert _tokens(llm) == want
        # the three prompts went as micro-batches of two and one, both in flight at once
        assert llm.llm_engine.engine_core.max_batches_in_flight == 2
    finally:
        llm.llm_engine.shutdown()
    assert not ray.is_initialized(), "the engine joined the cluster: it leaves it"
    assert _wait_gone([p.pid for p in places])
    _cluster_is_free(ray_address)


def test_vllm_pp_layer_partition_reaches_actors_that_do_not_inherit_it(smollm_gguf,
                                                                      smollm_single,
                                                                      ray_address, monkeypatch):
    """VLLM_PP_LAYER_PARTITION=20,10 set in the engine's process only (the cluster's nodes, and
    so its actors, started without it): the actors hold 20 and 10 layers (each one's KV block
    is its own layers') and the greedy tokens equal one process's."""
    want = smollm_single[len(PROMPTS)]
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "20,10")
    llm = LLM(model=str(smollm_gguf), pipeline_parallel_size=2,
              distributed_executor_backend="ray", **ENGINE)
    try:
        executor = llm.llm_engine.engine_core.executor
        assert isinstance(executor, RayExecutor)
        # the premise: a task in the cluster does not see the engine's variable
        env = ray.remote(num_cpus=0)(lambda: __import__("os").environ.get(
            "VLLM_PP_LAYER_PARTITION"))  # a local function: sent by value, not by module
        assert ray.get(env.remote()) is None
        block = executor._call_all("kv_block_bytes")
        assert block[0] == 2 * block[1], block
        assert _tokens(llm) == want
    finally:
        llm.llm_engine.shutdown()
    _cluster_is_free(ray_address)


@pytest.mark.parametrize("killed", [0, 1])
def test_a_killed_actor_fails_generate_with_its_rank_named(smollm_gguf, ray_address, killed):
    llm = LLM(model=str(smollm_gguf), pipeline_parallel_size=2,
              distributed_executor_backend="ray", **ENGINE)
    pids = [p.pid for p in llm.llm_engine.engine_core.executor.worker_places]
    try:
        err = kill_mid_generation(llm, PROMPTS, pids[killed])
        assert isinstance(err, WorkerDiedError), err
        assert f"Ray actor of pipeline rank {killed} (pid {pids[killed]} on node " in str(err)
        assert "the engine cannot continue" in str(err)
        # the engine stays failed, at once, with the same message
        started = time.monotonic()
        with pytest.raises(WorkerDiedError, match=f"pipeline rank {killed}"):
            llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
        assert time.monotonic() - started < 5
    finally:
        llm.llm_engine.shutdown()  # a second stop is harmless
    assert _wait_gone(pids), "an actor's process outlived the failure"
    _cluster_is_free(ray_address)


@pytest.mark.parametrize("stopped", [0, 1])
def test_a_stopped_actor_fails_generate_within_the_step_deadline(smollm_gguf, ray_address,
                                                                 stopped):
    """SIGSTOP of a stage's actor: ray.wait's timeout (the step deadline, step_timeout=1)
    fails the step with the stopped rank named (the other one, waiting on it, still answers a
    ping), and every actor is killed, the stopped one too."""
    from pagedllm.executor.deadline import WorkerHungError

    llm = LLM(model=str(smollm_gguf), pipeline_parallel_size=2, step_timeout=1,
              distributed_executor_backend="ray", **ENGINE)
    pids = [p.pid for p in llm.llm_engine.engine_core.executor.worker_places]
    try:
        started = time.monotonic()
        err = kill_mid_generation(llm, PROMPTS, pids[stopped], sig=signal.SIGSTOP)
        assert isinstance(err, WorkerHungError), err
        assert time.monotonic() - started < 20
        assert f"Ray actor of pipeline rank {stopped} (pid {pids[stopped]} on node " in str(err)
        assert "does not answer a ping in 2 s either and has not answered for" in str(err), err
        assert _wait_gone(pids), "an actor's process outlived the failure"
    finally:
        for pid in pids:
            if not gone([pid]):
                os.kill(pid, signal.SIGKILL)
        llm.llm_engine.shutdown()
    _cluster_is_free(ray_address)


def _tp_run(llm: LLM) -> tuple[list[list[int]], list[dict[int, float]]]:
    """Greedy tokens of each prompt, and the top-20 log-probabilities of its first position."""
    outs = llm.generate(PROMPTS, TP_GREEDY, use_tqdm=False)
    return ([list(o.outputs[0].token_ids) for o in outs],
            [{t: lp.logprob for t, lp in o.outputs[0].logprobs[0].items()} for o in outs])


def _tp2_mp(model: str) -> tuple[list[list[int]], list[dict[int, float]]]:
    """_tp_run of tensor_parallel_size=2 on the mp executor."""
    llm = LLM(model=model, tensor_parallel_size=2, **ENGINE)
    try:
        assert isinstance(llm.llm_engine.engine_core.executor, MultiprocExecutor)
        return _tp_run(llm)
    finally:
        llm.llm_engine.shutdown()


def test_tp2_on_two_ray_nodes_equals_mp_and_one_process(qwen_hf_dir, ray_address, caplog):
    """Qwen HF directory in float32, one tensor parallel rank on each node: the same greedy
    tokens as the mp executor's TP=2 and as one process, the log-probabilities within the
    all-reduce's summation order of one process's; rank 0 samples; each rank's collectives
    are counted; shutdown frees the cluster."""
    single = LLM(model=str(qwen_hf_dir), **ENGINE)
    want_tokens, want_lps = _tp_run(single)
    single.llm_engine.shutdown()
    del single
    mp_tokens, _ = _tp2_mp(str(qwen_hf_dir))
    caplog.set_level("INFO", logger="pagedllm")
    llm = LLM(model=str(qwen_hf_dir), tensor_parallel_size=2,
              distributed_executor_backend="ray", **ENGINE)
    try:
        executor = llm.llm_engine.engine_core.executor
        assert isinstance(executor, RayExecutor)
        places = executor.worker_places
        node_of = ray.util.placement_group_table(executor._cluster.group)["bundles_to_node_id"]
        assert len(set(node_of.values())) == 2, "STRICT_SPREAD: one rank on each node"
        assert len({p.node_ip + str(p.pid) for p in places}) == 2
        assert "tensor parallel rank 0 of 2" in executor.decode_path()
        tokens, lps = _tp_run(llm)
        # comm_stats, as bench -tp reads it: both ranks ran every step, each with the
        # embedding's all-reduce and two a layer (Qwen's 24)
        stats = llm.llm_engine.rank_comm_stats()
        assert stats[0]["forwards"] == stats[1]["forwards"] > 0
        assert [s["all_reduces"] for s in stats] == [49 * stats[0]["forwards"]] * 2
    finally:
        llm.llm_engine.shutdown()
    assert "tensor parallel on Ray" in caplog.text
    assert tokens == mp_tokens
    assert tokens == want_tokens
    for got, want in zip(lps, want_lps):
        common = got.keys() & want.keys()
        assert len(common) >= 15  # the top 20 may swap members at their tail's near-ties
        assert max(abs(got[t] - want[t]) for t in common) <= LOGPROB_TOL
    assert not ray.is_initialized()
    assert _wait_gone([p.pid for p in places])
    _cluster_is_free(ray_address)


@pytest.mark.parametrize("killed", [0, 1])
def test_a_killed_tp_actor_fails_generate_with_its_rank_named(qwen_hf_dir, ray_address, killed):
    """Rank 0 samples and holds the process group's store; rank 1 only computes: either one's
    death fails generate with that rank named, without a hang."""
    llm = LLM(model=str(qwen_hf_dir), tensor_parallel_size=2,
              distributed_executor_backend="ray", **ENGINE)
    pids = [p.pid for p in llm.llm_engine.engine_core.executor.worker_places]
    try:
        err = kill_mid_generation(llm, PROMPTS, pids[killed])
        assert isinstance(err, WorkerDiedError), err
        assert f"Ray actor of tensor parallel rank {killed} (pid {pids[killed]} on node " \
            in str(err)
        with pytest.raises(WorkerDiedError, match=f"tensor parallel rank {killed}"):
            llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    assert _wait_gone(pids), "an actor's process outlived the failure"
    _cluster_is_free(ray_address)


def test_a_cluster_without_room_is_refused_by_name(smollm_gguf, ray_address, monkeypatch):
    """Three ranks of one CPU on two one-CPU nodes: refused with the shortfall, after the
    placement timeout, and the placement group is removed."""
    monkeypatch.setattr(ray_executor, "PLACEMENT_TIMEOUT_S", 3.0)
    with pytest.raises(RuntimeError, match=r"the Ray cluster found no room for 3 pipeline parallel ranks "
                                           r"of \{'CPU': 1.0\} each \(PACK over 2 nodes"):
        LLM(model=str(smollm_gguf), pipeline_parallel_size=3,
            distributed_executor_backend="ray", **ENGINE)
    assert not ray.is_initialized()
    _cluster_is_free(ray_address)


def test_without_ray_address_the_engine_starts_a_local_ray_and_stops_it(smollm_gguf,
                                                                         smollm_single,
                                                                         monkeypatch):
    """No RAY_ADDRESS: a Ray instance of the engine's own (no web dashboard), gone with the engine,
    and the same tokens as one process."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    want = smollm_single[1]
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    llm = LLM(model=str(smollm_gguf), pipeline_parallel_size=2,
              distributed_executor_backend="ray", **ENGINE)
    try:
        started = {p.pid for p in psutil.Process().children(recursive=True)} - before
        assert started, "a local Ray instance runs under the engine's process"
        # Ray still runs its head process without a dashboard, its web front end off
        heads = [" ".join(psutil.Process(pid).cmdline()) for pid in started
                 if psutil.pid_exists(pid)]
        assert all("--disable-frontend" in c for c in heads if "dashboard/dashboard.py" in c)
        assert _tokens(llm, PROMPTS[:1]) == want
    finally:
        llm.llm_engine.shutdown()
    assert not ray.is_initialized()
    assert _wait_gone(list(started)), "a process of the local Ray instance outlived the engine"


def test_a_rank_that_fails_to_load_fails_the_start_with_its_rank_named(tmp_path, smollm_gguf,
                                                                        ray_address):
    """A NaN in layer 20's norm: rank 1 (layers 15-29) refuses it while loading; the engine
    reports that rank's error and the cluster is left free."""
    for file in smollm_gguf.parent.iterdir():  # the tokenizer files beside the GGUF
        if file.is_file() and file.suffix not in (".gguf", ".verified"):
            shutil.copy(file, tmp_path / file.name)
    norm = next(t for t in gguf_header(smollm_gguf)[1] if t.name == "blk.20.ffn_norm.weight")
    path = tmp_path / "nan.gguf"
    shutil.copy(smollm_gguf, path)
    with open(path, "r+b") as fh:
        fh.seek(norm.offset + 4 * 7)
        fh.write(struct.pack("<f", math.nan))
    with pytest.raises(WorkerError, match=r"pipeline rank 1 failed: ModelFileError: model\.layers"
                                          r"\.20\.post_attention_layernorm\.weight holds 1 NaN"):
        LLM(model=str(path), pipeline_parallel_size=2, distributed_executor_backend="ray",
            **ENGINE)
    assert not ray.is_initialized()
    _cluster_is_free(ray_address)


def test_serve_with_the_ray_backend_answers(ray_address, tmp_path):
    """`pagedllm serve -pp 2 --distributed-executor-backend ray` with RAY_ADDRESS set: the
    stages run as actors of that cluster, a completion comes back, and the cluster is free
    once the server stops."""
    import httpx

    port = free_port()
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve",
                                 "smollm2-135m-instruct", "--port", str(port), "-pp", "2",
                                 "--distributed-executor-backend", "ray",
                                 "--max-model-len", "256"], stdout=out, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_healthy(proc, url, log)
            body = httpx.post(f"{url}/v1/completions", timeout=60, json={
                "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0,
                "ignore_eos": True}).json()
            assert body["usage"]["completion_tokens"] == 8, body
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    assert "pipeline parallel on Ray" in log.read_text()
    _cluster_is_free(ray_address)


def test_the_ray_backend_without_ray_says_how_to_install_it():
    """`import ray` fails (as where the extra is not installed): one line, before any model is
    read."""
    script = ("import sys; sys.modules['ray'] = None\n"
              "from pagedllm import LLM\n"
              "try:\n"
              "    LLM(model='no-such-model', pipeline_parallel_size=2,\n"
              "        distributed_executor_backend='ray')\n"
              "except ValueError as err:\n"
              "    print(repr(str(err)))\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=DEADLINE_S,
                          env={**os.environ, "PYTHONPATH": str(Path(pagedllm.__file__).parents[1])})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == repr("distributed_executor_backend='ray' needs Ray, which is "
                                       "not installed: pip install 'pagedllm[ray]'")


def test_tp2_pp2_on_a_local_ray_equals_mp(qwen_hf_dir, monkeypatch):
    """tensor_parallel_size=2 x pipeline_parallel_size=2: four actors on the engine's own
    local Ray (the two-node cluster has two CPUs, one bundle each too few), laid out as the mp
    executor lays its processes out; the same greedy tokens as mp's four ranks."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    prompts, params = PROMPTS[:2], SamplingParams(temperature=0, max_tokens=8)
    engine = dict(ENGINE, tensor_parallel_size=2, pipeline_parallel_size=2)

    def run(llm: LLM) -> list[list[int]]:
        try:
            return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        finally:
            llm.llm_engine.shutdown()

    want = run(LLM(model=str(qwen_hf_dir), **engine))
    llm = LLM(model=str(qwen_hf_dir), distributed_executor_backend="ray", **engine)
    executor = llm.llm_engine.engine_core.executor
    assert isinstance(executor, RayExecutor)
    assert [r.place.name for r in executor._ranks][1:3] == [
        "pipeline stage 0, tensor parallel rank 1 (rank 1)",
        "pipeline stage 1, tensor parallel rank 0 (rank 2)"]
    assert run(llm) == want
    assert not ray.is_initialized()
