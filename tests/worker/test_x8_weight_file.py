"""File-backed block weights (mmap_weights): a GGUF's kept blocks regrouped once into a cache
file and mapped from it, giving the same tokens as blocks read into memory."""
from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.config_builder import make_engine_config
from pagedllm.layers.ggml_linear import GGMLLinear, GGMLMergedLinear
from pagedllm.loader.checkpoint import resolve_checkpoint
from pagedllm.loader.metadata import checkpoint_num_params
from pagedllm.memory.footprint import footprint
from pagedllm.memory.plan import InsufficientMemoryError, PlanLimits, plan_memory
from pagedllm.platforms.cpu import CpuPlatform
from pagedllm.platforms.interface import MemoryInfo, fmt_bytes
from pagedllm.worker import x8_weight_file

GiB = 1024 ** 3
QWEN7B = Path(__file__).resolve().parents[1] / "data" / "qwen2-7b-instruct-shapes"
SMALL_VM = MemoryInfo(int(3.49 * GiB), int(3.10 * GiB), "cgroup v1 limit 3.49 GiB, 3.10 GiB free")

PROMPTS = ["def fibonacci(n):", "The three primary colours are"]
GREEDY = SamplingParams(temperature=0, max_tokens=12)


@pytest.fixture
def weight_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The cache files of this test under tmp_path (the kernels' build cache stays put)."""
    root = tmp_path / "cache"
    monkeypatch.setattr(x8_weight_file, "cache_dir", lambda: root)
    return root


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _mapped_ranges(path: Path) -> list[tuple[int, int]]:
    """Address ranges of this process mapped from path (/proc/self/maps)."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.endswith(str(path)):
            start, end = line.split()[0].split("-")
            ranges.append((int(start, 16), int(end, 16)))
    return ranges


def _block_weights(llm: LLM) -> list:
    model = llm.llm_engine.engine_core.executor.model_runner.model
    out = []
    for m in model.modules():
        if isinstance(m, GGMLMergedLinear):
            out.extend(m.weights)
        elif isinstance(m, GGMLLinear):
            out.append(m.weight)
    return out


def test_mapped_blocks_give_the_same_tokens_and_are_read_from_the_file(qwen_gguf, weight_cache):
    reference = _tokens(LLM(model=str(qwen_gguf), max_model_len=512))
    llm = LLM(model=str(qwen_gguf), max_model_len=512, mmap_weights=True)
    assert llm.llm_engine.config.mmap_weights
    assert _tokens(llm) == reference
    (weights_bin,) = weight_cache.glob("x8-weights/*/*/weights.bin")
    ranges = _mapped_ranges(weights_bin)
    blocks = _block_weights(llm)
    assert ranges and blocks
    for w in blocks:  # every matrix the kernels read lies in the mapped file
        assert any(lo <= w.data_ptr() and w.data_ptr() + w.numel() <= hi for lo, hi in ranges)


def test_the_cache_is_written_once_and_again_when_stale_or_damaged(smollm_gguf, weight_cache,
                                                                   tmp_path):
    model_dir = tmp_path / "model"
    shutil.copytree(smollm_gguf.parent, model_dir)
    gguf = model_dir / smollm_gguf.name

    def run() -> tuple[list[list[int]], Path, int]:
        tokens = _tokens(LLM(model=str(gguf), mmap_weights=True, max_model_len=512))
        (path,) = weight_cache.glob("x8-weights/*/*/weights.bin")
        return tokens, path, path.stat().st_mtime_ns

    tokens, path, written = run()
    again, _, mtime = run()
    assert again == tokens and mtime == written  # read, not rewritten
    st = gguf.stat()
    os.utime(gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 10 ** 9))  # the GGUF changed
    again, _, mtime = run()
    assert again == tokens and mtime != written
    with open(path, "r+b") as fh:  # cut short: its index no longer fits the file
        fh.truncate(path.stat().st_size // 2)
    again, path, _ = run()
    assert again == tokens and path.stat().st_size > 0


def test_mmap_weights_needs_a_gguf_and_a_bool(smollm_hf_dir):
    with pytest.raises(ValueError, match="mmap_weights=True maps a GGUF's kept blocks"):
        LLM(model=str(smollm_hf_dir), mmap_weights=True)
    with pytest.raises(ValueError, match="mmap_weights must be True, False or None"):
        LLM(model=str(smollm_hf_dir), mmap_weights="yes")


def test_plan_with_mapped_blocks_leaves_the_page_cache_room_and_says_what_it_costs():
    ckpt = resolve_checkpoint(QWEN7B)
    fp = footprint(ckpt.arch, *checkpoint_num_params(ckpt)[:1], 4, "float32 with blocks kept",
                   "test")
    blocks = int(2.58 * GiB)
    mapped = dataclasses.replace(fp, weight_bytes=1 << 20, mapped_bytes=blocks)
    plan = plan_memory(mapped, SMALL_VM, PlanLimits(block_size=16, max_model_len=None,
                                                 max_num_seqs=64, max_num_batched_tokens=512))
    assert plan.max_model_len == 2048  # one short sequence of KV: the rest is for the blocks
    assert plan.kv_cache_bytes == 2048 * fp.kv_bytes_per_token
    assert 0 < plan.page_cache_room() < blocks
    # decoding, the kernel fills the cgroup with file pages: all of them fit (measured: 0 MiB
    # read a step at this limit); at 3.00 GiB they do not
    assert plan.reread_bytes_per_step() == 0 and "room for all of them" in plan.summary()
    tight = MemoryInfo(3 * GiB, int(2.84 * GiB), "cgroup v1 limit 3.00 GiB, 2.84 GiB free")
    plan = plan_memory(mapped, tight, PlanLimits(block_size=16, max_model_len=None,
                                                 max_num_seqs=64, max_num_batched_tokens=512,
                                                 mapped_forced=True))
    assert "mapped from a file, of which the page cache can hold" in plan.summary()
    assert f"re-reads ~{fmt_bytes(plan.reread_bytes_per_step())}" in plan.summary()
    roomy = dataclasses.replace(SMALL_VM, available_bytes=20 * GiB)
    plan = plan_memory(mapped, roomy, PlanLimits(block_size=16, max_model_len=None,
                                                 max_num_seqs=64, max_num_batched_tokens=512))
    assert plan.page_cache_room() >= blocks and "room for all of them" in plan.summary()
    assert footprint(fp.arch, fp.num_params, 4, "x", "y", 10, 4).weight_bytes == 6


def test_pipeline_stages_map_their_own_parts(qwen_gguf, weight_cache, monkeypatch):
    reference = _tokens(LLM(model=str(qwen_gguf), max_model_len=512))
    monkeypatch.undo()  # the ranks are processes of their own: they write to the real cache
    parts = [x8_weight_file.cache_path(qwen_gguf, f"pp{r}-of-2") for r in range(2)]
    try:
        llm = LLM(model=str(qwen_gguf), max_model_len=512, mmap_weights=True,
                  pipeline_parallel_size=2)
        assert _tokens(llm) == reference
        assert all((p / "weights.bin").is_file() for p in parts)
    finally:
        for p in parts:
            shutil.rmtree(p, ignore_errors=True)
        if parts[0].parent.is_dir() and not any(parts[0].parent.iterdir()):
            parts[0].parent.rmdir()


def test_mmap_weights_true_is_honoured_where_the_planner_would_not_map(smollm_gguf, monkeypatch,
                                                                       caplog):
    """In a memory whose page cache the planner judges short for the blocks, the default
    refuses; mmap_weights=True maps them anyway and warns what each decode step re-reads
    (here none: decoding keeps less resident than the planner plans for)."""
    small = MemoryInfo(625 << 20, 625 << 20, "test: 625 MiB")
    monkeypatch.setattr(CpuPlatform, "memory", lambda self: small)
    ckpt = resolve_checkpoint(smollm_gguf)
    with pytest.raises(InsufficientMemoryError, match="the page cache could hold only") as err:
        make_engine_config(EngineArgs(model=str(smollm_gguf), max_model_len=512), ckpt)
    assert err.value.page_cache
    caplog.set_level("WARNING", logger="pagedllm")
    config = make_engine_config(EngineArgs(model=str(smollm_gguf), max_model_len=512,
                                           mmap_weights=True), ckpt)
    assert config.mmap_weights
    assert "mmap_weights=True: the planner would not map the " in caplog.text
    assert "decoding should find them all in the page cache" in caplog.text
