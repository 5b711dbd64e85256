"""A real 3.5 GiB machine, made with a cgroup v1 memory limit: the default model loads and
generates with a KV cache sized to fit; a Qwen2-7B-shaped checkpoint is refused fast with advice."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Iterator

import pytest

from cgroup_v1 import CGROUP_V1_MEMORY, require_cgroup_v1

LIMIT = int(3.5 * 1024 ** 3)
QWEN7B = Path(__file__).resolve().parents[1] / "data" / "qwen2-7b-instruct-shapes"


@pytest.fixture
def small_machine():
    """A fresh cgroup limited to 3.5 GiB (needs root and cgroup v1's memory controller)."""
    require_cgroup_v1()
    cg = CGROUP_V1_MEMORY / f"pagedllm-test-{uuid.uuid4().hex[:8]}"
    cg.mkdir()
    try:
        (cg / "memory.limit_in_bytes").write_text(str(LIMIT))
        yield cg
    finally:
        cg.rmdir()


def run_inside(cg: Path, script: str, tmp_path: Path, timeout: int = 600):
    """Run a Python script as a process inside the cgroup."""
    path = tmp_path / "job.py"
    path.write_text(script)
    return subprocess.run(
        ["sh", "-c", f'echo $$ > {cg}/cgroup.procs && exec "{sys.executable}" "{path}"'],
        capture_output=True, text=True, timeout=timeout)


DEFAULT_MODEL_JOB = """
import json
from pagedllm import LLM, SamplingParams
llm = LLM(model="qwen2.5-coder-0.5b-instruct")
out = llm.generate(["def fibonacci(n):"], SamplingParams(temperature=0, max_tokens=24),
                   use_tqdm=False)[0]
cfg = llm.llm_engine.config
print(json.dumps({"dtype": str(cfg.dtype), "num_blocks": cfg.cache.num_blocks,
                  "max_model_len": cfg.scheduler.max_model_len, "text": out.outputs[0].text}))
"""


def test_default_model_runs_in_3_5_gib(small_machine, tmp_path, qwen_gguf):
    proc = run_inside(small_machine, DEFAULT_MODEL_JOB, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["num_blocks"] > 0 and result["max_model_len"] >= 2048
    assert "return" in result["text"] or "fib" in result["text"], result["text"]
    peak = int((small_machine / "memory.max_usage_in_bytes").read_text())
    assert peak <= LIMIT
    oom = (small_machine / "memory.oom_control").read_text()
    assert "oom_kill 0" in oom or "oom_kill" not in oom


PAGE_CACHE_JOB = """
import json, os
from pathlib import Path
from pagedllm.platforms.cgroup import memory_limit
before = memory_limit().free_bytes
path = Path(os.environ["BIG_FILE"])
with open(path, "wb") as fh:  # 1.5 GB of page cache charged to this cgroup, clean once synced
    for _ in range(96):
        fh.write(os.urandom(16 << 20))
    fh.flush()
    os.fsync(fh.fileno())
for _ in range(2):  # read twice: the pages move to the active list
    with open(path, "rb") as fh:
        while fh.read(16 << 20):
            pass
stat = dict(line.split() for line in Path(os.environ["CG"], "memory.stat").read_text().splitlines())
print(json.dumps({"before": before, "after": memory_limit().free_bytes,
                  "cache": int(stat["total_cache"])}))
"""


def test_clean_page_cache_counts_as_free(small_machine, tmp_path):
    """Files an earlier process read stay cached in the cgroup; the kernel would reclaim them,
    so the planner must not count them as used (the seed user's second run)."""
    path = tmp_path / "job.py"
    path.write_text(PAGE_CACHE_JOB)
    env = {**os.environ, "BIG_FILE": str(tmp_path / "big.bin"), "CG": str(small_machine)}
    proc = subprocess.run(
        ["sh", "-c", f'echo $$ > {small_machine}/cgroup.procs && exec "{sys.executable}" "{path}"'],
        capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["cache"] > 1024 ** 3  # the cgroup really holds the file's pages
    assert abs(got["after"] - got["before"]) < 128 * 1024 ** 2, got


QWEN7B_JOB = f"""
import time
from pagedllm import LLM
started = time.monotonic()
try:
    LLM(model={str(QWEN7B)!r})
except ValueError as err:
    print(f"{{time.monotonic() - started:.3f}}")
    print(err)
else:
    print("loaded?!")
"""


def test_qwen7b_is_refused_fast_with_advice(small_machine, tmp_path):
    proc = run_inside(small_machine, QWEN7B_JOB, tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seconds, *message = proc.stdout.strip().splitlines()
    text = "\n".join(message)
    assert float(seconds) < 2.0
    assert "does not fit in memory" in text and "cgroup v1 limit 3.50 GiB" in text
    assert "4-bit GGUF" in text and "smaller model of the same family" in text
    assert "machines like this one" in text and "pipeline_parallel_size=" in text


@pytest.fixture
def seed_vm() -> Iterator[Path]:
    """A fresh cgroup of the seed user's VM: 3.49 GiB (needs root and cgroup v1)."""
    require_cgroup_v1()
    cg = CGROUP_V1_MEMORY / f"pagedllm-doctor-{uuid.uuid4().hex[:8]}"
    cg.mkdir()
    try:
        (cg / "memory.limit_in_bytes").write_text(str(SEED_VM_LIMIT))
        yield cg
    finally:
        cg.rmdir()


def test_doctor_in_the_seed_vm_names_the_tested_way_first(seed_vm, tmp_path):
    """doctor on Qwen2-7B-Instruct's shapes in a 3.49 GiB cgroup: the tested way (a Q4_K_M
    GGUF at -pp 2 over two such machines) first, with where to get it; then every format by
    its expected speed: int4 made at load over four such machines (-tp 4), then the Q2_K GGUF
    with its blocks mapped on this one; machine counts equal to the sizes, TP sizes that divide
    the 28 heads and 4 KV heads."""
    job = ("import sys; from pagedllm.entrypoints.cli import main; "
           f"sys.exit(main(['doctor', {str(QWEN7B)!r}] + sys.argv[1:]))")
    script = tmp_path / "doctor.py"
    script.write_text(job)
    runs = [subprocess.run(["sh", "-c", f'echo $$ > {seed_vm}/cgroup.procs && exec '
                            f'"{sys.executable}" "{script}" {flag}'],
                           capture_output=True, text=True, timeout=120) for flag in ("--json", "")]
    assert [p.returncode for p in runs] == [1, 1], runs[0].stderr[-3000:]  # 1: does not fit
    report = json.loads(runs[0].stdout)
    assert report["memory"]["source"].startswith("cgroup v1 limit 3.49 GiB")
    model = report["model_report"]
    assert model["fits"] is False and report["seconds"] < 3.0
    assert model["tested_way"] == {**model["tested_way"], "format": "Q4_K_M", "machines": 2,
                                   "pipeline_parallel_size": 2, "tensor_parallel_size": 1}
    fastest = model["fastest_way"]
    assert (fastest["format"], fastest["machines"], fastest["tensor_parallel_size"]) == (
        "int4", 4, 4)
    assert {w["format"] for w in model["ways_out"]} == {"Q4_K_M", "Q2_K", "int4", "int8", "bf16"}
    # the default for this bf16 checkpoint is its bf16 matrices on pagedllm's kernels
    # (quantization "bf16"), which compute in float32: a float32 KV cache and the regrouping
    # peak (planned as the matrices twice) leave no even split over such machines; the bf16
    # way (dtype='bfloat16', 8 machines) stays among the ways out
    assert model["quantization"] == "bf16"
    assert model["machines_needed"] == {"pipeline_parallel_size": None,
                                        "tensor_parallel_size": None}
    text = runs[1].stdout
    ways = text[text.index("ways out"):].split("\n")[1:]
    assert ways[0].startswith("    - the tested way: a Q4_K_M GGUF with pipeline_parallel_size=2 "
                              "over two machines like this one")
    assert "pagedllm serve Qwen/Qwen2-7B-Instruct-GGUF:Q4_K_M -pp 2" in ways[0]
    assert ways[1].startswith("    - int4 at load (quantization='int4': Q4_1 blocks)")
    assert ways[2].startswith("    - a 2-bit GGUF (Q2_K), weights ~2.83 GiB: fits on this machine, "
                              "its blocks mapped from a file")
    for size, count in re.findall(r"_parallel_size=(\d+) over (\d+) machines", text):
        assert size == count
    for size in map(int, re.findall(r"tensor_parallel_size=(\d+)", text)):
        assert 28 % size == 0 and 4 % size == 0
    print("\n" + text[text.index("model "):])


# The seed user's VM: 3.49 GiB, and a Qwen2-7B-shaped Q2_K GGUF (random blocks, ~2.8 GB)
SEED_VM_LIMIT = 3_750_588_416


@pytest.fixture(scope="module")
def qwen7b_q2_k(tmp_path_factory) -> Iterator[Path]:
    """The GGUF in a temporary directory; it and its regrouped copy are removed after."""
    from big_gguf import drop_regrouped_copies, write_qwen7b_gguf
    path = tmp_path_factory.mktemp("qwen7b") / "qwen2-7b-random-q2_k.gguf"
    write_qwen7b_gguf(path)
    try:
        yield path
    finally:
        drop_regrouped_copies(path)
        shutil.rmtree(path.parent, ignore_errors=True)


Q2K_JOB = """
import json, sys, time
from pagedllm import LLM, SamplingParams
from pagedllm.memory.plan import InsufficientMemoryError
try:
    LLM(model=sys.argv[1], mmap_weights=False)
except InsufficientMemoryError as err:
    refused = str(err)
else:
    refused = None
started = time.monotonic()
llm = LLM(model=sys.argv[1])
loaded = time.monotonic()
params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
runs = []
for prompt in ("Hello, my name is", "The weather today is"):
    t = time.monotonic()
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    runs.append((time.monotonic() - t, len(out.outputs[0].token_ids)))
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
print(json.dumps({"refused": refused, "mmap": llm.llm_engine.config.mmap_weights,
                  "load_s": loaded - started, "runs": runs, "VmHWM": status["VmHWM"].strip()}))
"""


@pytest.mark.parametrize("load", ["first (writes the regrouped copy)", "second (maps it)"])
def test_qwen7b_q2_k_generates_in_3_49_gib(load, qwen7b_q2_k, tmp_path):
    require_cgroup_v1()
    cg = CGROUP_V1_MEMORY / f"pagedllm-seed-{uuid.uuid4().hex[:8]}"
    cg.mkdir()
    try:
        (cg / "memory.limit_in_bytes").write_text(str(SEED_VM_LIMIT))
        script = tmp_path / "job.py"
        script.write_text(Q2K_JOB)
        # page cache charged to an earlier cgroup would not count here: start from disk
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("1")
        proc = subprocess.run(
            ["sh", "-c", f'echo $$ > {cg}/cgroup.procs && exec "{sys.executable}" "{script}" '
             f'"{qwen7b_q2_k}"'], capture_output=True, text=True, timeout=600)
        oom = (cg / "memory.oom_control").read_text()
        peak = int((cg / "memory.max_usage_in_bytes").read_text())
    finally:
        cg.rmdir()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "oom_kill 0" in oom
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    # in anonymous memory the planner refuses it; mapped, it runs
    assert result["refused"] and "does not fit in memory" in result["refused"]
    assert result["mmap"] is True
    assert all(n == 8 for _, n in result["runs"])
    assert peak <= SEED_VM_LIMIT
    print(f"\n{load}: load {result['load_s']:.1f} s, 8 tokens in "
          f"{', '.join(f'{s:.1f}' for s, _ in result['runs'])} s, peak {peak / 2**30:.2f} GiB, "
          f"VmHWM {result['VmHWM']}")


def test_doctor_says_whether_a_draft_fits_beside_the_7b(seed_vm, qwen7b_q2_k, qwen_gguf,
                                                      tmp_path):
    """The default model as a draft for the Qwen2-7B-shaped Q2_K GGUF in the seed VM: with
    max_model_len 512 both fit (the 7B's blocks mapped, the draft's in memory, one KV cache
    of both); with 2048 the page cache left for the mapped blocks is too short, and doctor
    says so and exits 1."""
    script = tmp_path / "doctor.py"
    script.write_text("import sys; from pagedllm.entrypoints.cli import main; "
                      "sys.exit(main(['doctor'] + sys.argv[1:]))")
    spec = json.dumps({"model": str(qwen_gguf), "num_speculative_tokens": 4})
    reports = {}
    for length in (512, 2048):
        proc = subprocess.run(["sh", "-c", f'echo $$ > {seed_vm}/cgroup.procs && exec '
                               f'"{sys.executable}" "{script}" "$@"', "sh", str(qwen7b_q2_k),
                               "--json", "--max-model-len", str(length),
                               "--speculative-config", spec],
                              capture_output=True, text=True, timeout=120)
        reports[length] = (proc.returncode, json.loads(proc.stdout)["model_report"])
    rc, fits = reports[512]
    assert rc == 0 and fits["fits"] and fits["draft"]["fits"], fits
    assert 0.1 < fits["draft"]["bytes_per_token_vs_target"] < 0.25  # 463 MiB of ~2.6 GiB
    rc, short = reports[2048]
    assert rc == 1 and short["fits"] and not short["draft"]["fits"]
    assert "page cache" in short["draft"]["reason"]


# The seed user's way out: two such VMs, pipeline_parallel_size=2, each rank in its own 3.49 GiB
# cgroup, serving a Qwen2-7B-shaped 4-bit GGUF (Q4_K blocks, Q6_K head: ~4.4 GB, random; the
# session's qwen7b_q4_k, tests/conftest.py)


@pytest.fixture
def seed_cgroups() -> Iterator[list[Path]]:
    """Three fresh cgroups of the seed VM's limit: one for the single process, one per rank."""
    require_cgroup_v1()
    tag = uuid.uuid4().hex[:8]
    cgs = [CGROUP_V1_MEMORY / f"pagedllm-seed-{tag}-{name}" for name in ("one", "0", "1")]
    for cg in cgs:
        cg.mkdir()
        (cg / "memory.limit_in_bytes").write_text(str(SEED_VM_LIMIT))
    try:
        yield cgs
    finally:
        for cg in cgs:
            for _ in range(50):  # a rank's process may still be exiting
                try:
                    cg.rmdir()
                    break
                except OSError:
                    import time
                    time.sleep(0.2)


SINGLE_JOB = """
import json, sys, time
from pagedllm import LLM
from pagedllm.memory.plan import InsufficientMemoryError
started = time.monotonic()
try:
    LLM(model=sys.argv[1])
except InsufficientMemoryError as err:
    print(json.dumps({"refused": str(err), "machines": err.machines,
                      "seconds": time.monotonic() - started}))
else:
    print(json.dumps({"refused": None}))
"""

PP_JOB = """
import json, sys, time
from pagedllm import LLM, SamplingParams
started = time.monotonic()
llm = LLM(model=sys.argv[1], pipeline_parallel_size=2, max_model_len=2048)
loaded = time.monotonic()
prompt = "The weather today is"
t = time.monotonic()
first = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
                     use_tqdm=False)[0]
prefill = time.monotonic() - t
t = time.monotonic()
out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=17, ignore_eos=True),
                   use_tqdm=False)[0]
total = time.monotonic() - t
cfg = llm.llm_engine.config
ranks = []  # what each rank's process holds: peak RSS, anonymous and file-backed (mapped) now
for pid in llm.llm_engine.engine_core.executor.worker_pids:
    status = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status"))
    ranks.append({k: status[k].strip() for k in ("VmHWM", "RssAnon", "RssFile")})
print(json.dumps({"ranks": ranks, "load_s": loaded - started, "prefill_s": prefill, "total_s": total,
                  "tokens": len(out.outputs[0].token_ids),
                  "same_first": out.outputs[0].token_ids[0] == first.outputs[0].token_ids[0],
                  "decode_tok_s": 16 / max(1e-9, total - prefill),
                  "mmap": cfg.mmap_weights, "num_blocks": cfg.cache.num_blocks,
                  "max_model_len": cfg.scheduler.max_model_len}))
"""


def test_qwen7b_q4_k_pp2_runs_in_two_3_49_gib_cgroups(qwen7b_q4_k, seed_cgroups, tmp_path):
    one, rank0, rank1 = seed_cgroups
    # (a) one process in one such cgroup: the planner refuses it, even mapped from a file
    proc = run_inside(one, SINGLE_JOB.replace("sys.argv[1]", repr(str(qwen7b_q4_k))), tmp_path,
                      timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    single = json.loads(proc.stdout.strip().splitlines()[-1])
    assert single["refused"] is not None, "a 4.4 GB GGUF was planned into 3.49 GiB"
    text = single["refused"]
    assert "does not fit in memory" in text and "the page cache could hold only" in text
    assert single["machines"]["pipeline_parallel_size"] == 2
    assert ("this GGUF as it is: pipeline_parallel_size=2 over 2 machines like this one" in text
            and "the tested way: a Q4_K_M GGUF with pipeline_parallel_size=2" in text)
    assert single["seconds"] < 5.0
    # (b) two ranks, each in its own cgroup; the engine process (tokenizer, scheduler) outside
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("1")  # page cache charged elsewhere: none
    script = tmp_path / "pp.py"
    script.write_text(PP_JOB)
    # only the name's last "-0": the random tag may hold a "-0" too (a tag starting with 0)
    template = str(rank0)[:-len("-0")] + "-{rank}"
    env = dict(os.environ, PAGEDLLM_RANK_CGROUP=template)
    proc = subprocess.run([sys.executable, str(script), str(qwen7b_q4_k)], capture_output=True,
                          text=True, timeout=600, env=env)
    ooms = [(cg / "memory.oom_control").read_text() for cg in (rank0, rank1)]
    # max_usage counts the page cache that holds the mapped blocks (the kernel fills the
    # cgroup to its limit and reclaims); rss is what the ranks hold themselves
    peaks = [int((cg / "memory.max_usage_in_bytes").read_text()) for cg in (rank0, rank1)]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert all("oom_kill 0" in oom for oom in ooms), ooms
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["tokens"] == 17 and result["same_first"]
    # each rank's 2.0-2.1 GiB of blocks would fit in anonymous memory, but not their load
    # (read, then regrouped): the planner maps each stage's blocks from its own file
    assert result["mmap"] is True and result["max_model_len"] == 2048
    assert all(0 < p <= SEED_VM_LIMIT for p in peaks)
    # each rank joined its cgroup and planned its share against it
    assert "pipeline rank 1 of 2: layers 14-27, head" in proc.stderr
    assert f"{rank1}: cgroup v1 limit 3.49 GiB" in proc.stderr
    print(f"\nPP=2 Qwen2-7B Q4_K, a 3.49 GiB cgroup per rank: load {result['load_s']:.1f} s, "
          f"prefill {result['prefill_s']:.2f} s, decode {result['decode_tok_s']:.2f} tok/s, "
          f"peak rank 0 {peaks[0] / 2**30:.2f} GiB, rank 1 {peaks[1] / 2**30:.2f} GiB, "
          f"mmap_weights {result['mmap']}, {result['num_blocks']} KV blocks; ranks' own "
          f"memory: {result['ranks']}")
