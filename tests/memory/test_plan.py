"""Memory planning from metadata: what fits, what is chosen, and the advice when nothing fits."""
import dataclasses
import json
import math
import time
from pathlib import Path

import pytest
import torch

from pagedllm import LLM
from pagedllm.config import EngineConfig
from pagedllm.distributed.stage import PipelineStage
from pagedllm.distributed.tensor_parallel import TensorParallelRank
from pagedllm.loader.checkpoint import resolve_checkpoint
from pagedllm.loader.metadata import checkpoint_num_params
from pagedllm.memory.advice_text import advise
from pagedllm.memory.footprint import footprint, kv_bytes_per_token, stage_footprint, tp_share
from pagedllm.memory.plan import (DISK_READ_BYTES_PER_S, MEMORY_UTILIZATION,
                                  InsufficientMemoryError, PlanLimits, plan_memory,
                                  plan_pipeline_memory)
from pagedllm.memory.weight_layout import planned_weight_layout
from pagedllm.platforms.cpu import CpuPlatform
from pagedllm.platforms.interface import MemoryInfo, fmt_bytes
from pagedllm.worker.model_loader import load_model

GiB = 1024 ** 3
QWEN7B = Path(__file__).resolve().parents[1] / "data" / "qwen2-7b-instruct-shapes"
SMALL_VM = MemoryInfo(int(3.49 * GiB), int(3.10 * GiB), "cgroup v1 limit 3.49 GiB, 3.10 GiB free")


def qwen7b_footprint(itemsize=2, name="bfloat16"):
    ckpt = resolve_checkpoint(QWEN7B)
    n, source = checkpoint_num_params(ckpt)
    return footprint(ckpt.arch, n, itemsize, name, source)


def test_parameter_count_from_config_matches_the_real_shapes():
    ckpt = resolve_checkpoint(QWEN7B)
    shapes = json.loads((QWEN7B / "shapes.json").read_text())["shapes"]
    assert ckpt.arch.num_params() == sum(math.prod(s) for s in shapes.values()) == 7_615_616_512
    assert checkpoint_num_params(ckpt) == (7_615_616_512, "safetensors index total_size")
    index = json.loads((QWEN7B / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(shapes)


def test_kv_bytes_per_token():
    arch = resolve_checkpoint(QWEN7B).arch
    assert kv_bytes_per_token(arch, 2) == 28 * 2 * 4 * 128 * 2  # 57344


def test_qwen7b_on_a_3_5_gib_machine_gets_advice():
    with pytest.raises(InsufficientMemoryError) as err:
        plan_memory(qwen7b_footprint(), SMALL_VM, PlanLimits(block_size=16, max_model_len=None,
                                                             max_num_seqs=64,
                                                             max_num_batched_tokens=2048),
                    advisor=advise)
    msg = str(err.value)
    assert "needs" in msg and "weights 14.19 GiB" in msg and "7.62 B parameters" in msg
    assert "KV cache" in msg and "2048 tokens" in msg
    assert "cgroup v1 limit 3.49 GiB, 3.10 GiB free" in msg
    # 3.10 GiB free and a 2048-token step's activations: the GGUFs need more than one machine
    assert "a 4-bit GGUF (Q4_K_M), weights ~4.39 GiB: pipeline_parallel_size=3 over 3" in msg
    assert "a 2-bit GGUF (Q2_K), weights ~2.83 GiB: pipeline_parallel_size=2 over 2" in msg
    assert "int8 at load" in msg and "bf16 weights (dtype='bfloat16')" in msg
    assert "smaller model of the same family: Qwen2.5-0.5B-Instruct" in msg


def test_advice_names_the_low_bit_gguf_that_would_fit():
    with pytest.raises(InsufficientMemoryError) as err:  # 4.5 GiB: Q2_K mapped, Q4_K_M on two
        plan_memory(qwen7b_footprint(), MemoryInfo(8 * GiB, int(4.5 * GiB), "test"),
                    PlanLimits(block_size=16, max_model_len=None, max_num_seqs=64,
                               max_num_batched_tokens=2048), advisor=advise)
    msg = str(err.value)
    # in anonymous memory its load (blocks read, then regrouped) would peak at twice its size
    assert ("a 2-bit GGUF (Q2_K), weights ~2.83 GiB: fits on this machine, its blocks mapped "
            "from a file (the page cache holds ~100% of them): ~") in msg
    assert ("the tested way: a Q4_K_M GGUF with pipeline_parallel_size=2 over two machines like "
            "this one") in msg


def test_advice_offers_a_gguf_whose_blocks_the_page_cache_would_mostly_hold():
    vm = MemoryInfo(int(3.49 * GiB), int(3.34 * GiB), "cgroup v1 limit 3.49 GiB, 3.34 GiB free")
    with pytest.raises(InsufficientMemoryError) as err:
        plan_memory(qwen7b_footprint(), vm, PlanLimits(block_size=16, max_model_len=None,
                                                       max_num_seqs=64, max_num_batched_tokens=512),
                    advisor=advise)
    msg = str(err.value)
    assert ("a 2-bit GGUF (Q2_K), weights ~2.83 GiB: fits on this machine, its blocks mapped "
            "from a file (the page cache holds ~100% of them)") in msg


def test_a_fitting_model_gets_a_cache_and_the_full_length():
    fp = qwen7b_footprint()
    plan = plan_memory(fp, MemoryInfo(64 * GiB, 60 * GiB, "test"),
                       PlanLimits(block_size=16, max_model_len=None, max_num_seqs=8,
                                  max_num_batched_tokens=2048))
    assert plan.max_model_len == 32768 and plan.num_blocks * 16 >= 32768
    explicit = plan_memory(fp, MemoryInfo(64 * GiB, 60 * GiB, "test"),
                           PlanLimits(block_size=16, max_model_len=4096, max_num_seqs=8,
                                      max_num_batched_tokens=2048))
    assert explicit.max_model_len == 4096


def test_limits_are_checked():
    fp = qwen7b_footprint()
    big = MemoryInfo(64 * GiB, 60 * GiB, "test")
    with pytest.raises(ValueError, match="max_model_len=65536 is larger than the model supports"):
        plan_memory(fp, big, PlanLimits(block_size=16, max_model_len=65536, max_num_seqs=8,
                                        max_num_batched_tokens=2048))
    with pytest.raises(ValueError, match="does not fit the KV cache"):
        plan_memory(fp, big, PlanLimits(block_size=16, max_model_len=4096, max_num_seqs=8,
                                        max_num_batched_tokens=2048, num_blocks=8))
    with pytest.raises(InsufficientMemoryError):
        plan_memory(fp, big, PlanLimits(block_size=16, max_model_len=None, max_num_seqs=8,
                                        max_num_batched_tokens=2048, kv_cache_bytes=100 * GiB))


def test_llm_refuses_qwen7b_fast_before_loading(monkeypatch):
    monkeypatch.setattr(CpuPlatform, "memory", lambda self: SMALL_VM)
    started = time.monotonic()
    with pytest.raises(InsufficientMemoryError, match="does not fit in memory"):
        LLM(model=str(QWEN7B), device="cpu")
    assert time.monotonic() - started < 2.0


def test_a_sliding_window_does_not_cap_max_model_len():
    """Windowed layers attend over the window, the cache still holds the whole sequence: the
    plan is the windowless one's."""
    fp = qwen7b_footprint()
    windowed = dataclasses.replace(fp, arch=dataclasses.replace(fp.arch, sliding_window=4096))
    big = MemoryInfo(64 * GiB, 60 * GiB, "test")
    plans = [plan_memory(f, big, PlanLimits(block_size=16, max_model_len=None, max_num_seqs=8,
                                            max_num_batched_tokens=2048)) for f in (fp, windowed)]
    assert plans[0] == plans[1]
    assert plans[1].max_model_len == fp.arch.max_position_embeddings == 32768


def _qwen_kept_blocks(qwen_gguf):
    """The Qwen Q4_K_M GGUF with its blocks kept, as the planner sees it: the platform (kernels
    loaded, for the x8 packing's sizes), the checkpoint, its planned weight layout and the
    whole model's float32 footprint."""
    platform = CpuPlatform()
    platform.load_kernels()
    ckpt = resolve_checkpoint(qwen_gguf)
    layout = planned_weight_layout(ckpt, platform.block_types(), "gguf", 4)
    n, source = checkpoint_num_params(ckpt)
    fp = footprint(ckpt.arch, n, 4, "float32 with GGUF blocks kept", source, layout.total, 0,
                   layout)
    return platform, ckpt, layout, fp


# a short plan (one 256-token sequence or two) against more memory than any test model needs
SHORT = dict(block_size=16, max_model_len=256, max_num_seqs=2, max_num_batched_tokens=256,
             kv_cache_bytes=16 * 2**20)
PLENTY = MemoryInfo(64 * GiB, 64 * GiB, "plenty")


def test_tp_plans_the_largest_rank_of_an_uneven_block_split(qwen_gguf):
    """Qwen Q4_K_M with its blocks kept at tensor_parallel_size=2: rank 0 holds 10 of each
    down_proj row's 19 K-quant blocks (and the matching gate/up rows), rank 1 nine; the plan's
    largest rank is rank 0's loaded bytes (within the replicated norms and biases), above half
    the model by half the ranks' difference."""
    platform, ckpt, layout, _ = _qwen_kept_blocks(qwen_gguf)
    assert layout.mlp_block == 256
    planned = layout.tp_rank_bytes(2, ckpt.arch.intermediate_size)
    config = EngineConfig(model_path=str(qwen_gguf), arch=ckpt.arch, dtype=torch.float32,
                          platform=platform, quantization="gguf")
    held = [sum(p.nbytes for p in load_model(config, tp=TensorParallelRank(r, 2)).parameters())
            for r in range(2)]
    assert abs(planned - held[0]) <= 0.005 * held[0]
    excess = (held[0] - held[1]) / 2  # 5.7 MB
    assert abs(planned - layout.total // 2 - excess) <= 0.05 * excess


def test_tp_x_pp_plans_each_rank_its_stage_over_the_tp_ranks(qwen_gguf):
    """Qwen Q4_K_M, blocks kept, tensor_parallel_size=2 x pipeline_parallel_size=2: each of
    the four ranks is planned about what it loads (its TP share of its stage's layers, the
    first stage's embedding and the last's head split too), not its whole stage; with each
    rank in a memory a little above its share, the plan fits where a whole stage would not."""
    platform, ckpt, _, fp = _qwen_kept_blocks(qwen_gguf)
    config = EngineConfig(model_path=str(qwen_gguf), arch=ckpt.arch, dtype=torch.float32,
                          platform=platform, quantization="gguf")
    shares = []
    for s in range(2):
        stage = PipelineStage.of_rank(ckpt.arch.num_hidden_layers, s, 2)
        share = tp_share(stage_footprint(fp, stage), 2)  # the stage's larger TP rank (10 blocks)
        held = max(sum(p.nbytes for p in load_model(config, stage, TensorParallelRank(t, 2))
                       .parameters()) for t in range(2))
        assert abs(share.weight_bytes - held) <= 0.03 * held, (s, share.weight_bytes, held)
        assert share.kv_bytes_per_token == fp.kv_bytes_per_token // 4  # 12 layers, 1 KV head
        shares.append(share)
    needs = [plan_memory(s, PLENTY, PlanLimits(**SHORT)) for s in shares]
    need = max(p.weight_bytes + p.kv_cache_bytes + p.activation_bytes + p.overhead_bytes
               for p in needs)
    room = int(need / MEMORY_UTILIZATION) + 2**20  # each rank's cgroup: its share just fits
    mems = [MemoryInfo(room, room, f"rank {r}'s cgroup") for r in range(4)]
    plan = plan_pipeline_memory(fp, 2, mems[0], PlanLimits(**SHORT), mems, tp_size=2)
    assert len(plan.ranks) == 4 and plan.max_model_len == 256
    assert plan.weight_bytes == max(s.weight_bytes for s in shares)
    stage0 = stage_footprint(fp, PipelineStage.of_rank(ckpt.arch.num_hidden_layers, 0, 2))
    with pytest.raises(InsufficientMemoryError):  # a whole stage, as planned before TP x PP
        plan_memory(stage0, mems[0], PlanLimits(**SHORT))


def test_lora_adapters_are_planned_on_each_stage_and_tp_rank(qwen_gguf):
    """LoRA's bytes (lora_bytes: tp_size times one rank's part) go with the layers: each of
    two pipeline stages of 12 layers plans half of them, and its larger TP rank about half of
    that (a stage once planned none: its weights come from the layout alone)."""
    from pagedllm.config import LoRAConfig
    from pagedllm.memory.footprint import lora_bytes

    fp = _qwen_kept_blocks(qwen_gguf)[3]
    lora = LoRAConfig(max_loras=2, max_lora_rank=16)
    extra = lora_bytes(fp.arch, lora, 2)
    assert lora_bytes(fp.arch, lora) < extra < 2 * lora_bytes(fp.arch, lora)  # a rank: > half
    with_lora = dataclasses.replace(fp, weight_bytes=fp.weight_bytes + extra, lora_bytes=extra)
    for s in range(2):
        stage = PipelineStage.of_rank(fp.arch.num_hidden_layers, s, 2)
        base, ours = stage_footprint(fp, stage), stage_footprint(with_lora, stage)
        assert ours.weight_bytes - base.weight_bytes == ours.lora_bytes == extra // 2
        rank = tp_share(ours, 2).weight_bytes - tp_share(base, 2).weight_bytes
        assert abs(rank - extra // 4) <= 0.1 * extra // 4


def test_pipeline_plan_follows_vllm_pp_layer_partition(qwen_gguf, monkeypatch):
    """VLLM_PP_LAYER_PARTITION=16,8 on Qwen's 24 layers: each rank is planned its own layers
    (rank 0 twice rank 1's KV cache per block, layers 0-15 and 16-23 named, four layers'
    weights moved from rank 1 to rank 0)."""
    fp = _qwen_kept_blocks(qwen_gguf)[3]
    even = plan_pipeline_memory(fp, 2, PLENTY, PlanLimits(**SHORT), [PLENTY, PLENTY])
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "16,8")
    plan = plan_pipeline_memory(fp, 2, PLENTY, PlanLimits(**SHORT), [PLENTY, PLENTY])
    assert "layers 0-15, embedding" in plan.ranks[0].where
    assert "layers 16-23, head" in plan.ranks[1].where
    per_block = [p.kv_cache_bytes // p.num_blocks for p in plan.ranks]
    assert per_block[0] == 2 * per_block[1]
    # rank 0 gains 4 layers' weights, rank 1 loses them
    assert plan.ranks[0].weight_bytes > even.ranks[0].weight_bytes
    assert plan.ranks[1].weight_bytes < even.ranks[1].weight_bytes


def test_mmap_weights_true_keeps_a_mapped_plan_the_page_cache_cannot_hold_and_warns():
    """A 7B's 2.58 GiB of Q2_K blocks mapped in a 3.00 GiB cgroup: refused when the planner
    chooses (the page cache holds under 75 %), kept when asked for, with the re-read per step."""
    fp = qwen7b_footprint(4, "float32 with GGUF blocks kept")
    mapped = dataclasses.replace(fp, weight_bytes=300 << 20, mapped_bytes=int(2.58 * GiB))
    tight = MemoryInfo(3 * GiB, int(2.85 * GiB), "cgroup v1 limit 3.00 GiB, 2.85 GiB free")
    sizes = dict(block_size=16, max_model_len=None, max_num_seqs=64, max_num_batched_tokens=512)
    with pytest.raises(InsufficientMemoryError, match="the page cache could hold only") as err:
        plan_memory(mapped, tight, PlanLimits(**sizes))
    assert err.value.page_cache
    plan = plan_memory(mapped, tight, PlanLimits(mapped_forced=True, **sizes))
    assert plan.mapped_bytes == mapped.mapped_bytes and plan.max_model_len == 2048
    assert plan.mapped_tight()
    reread = plan.reread_bytes_per_step()
    # short of 18 % of them, decoding cycles nearly all of them through the page cache
    assert mapped.mapped_bytes - plan.expected_page_cache() < reread <= mapped.mapped_bytes
    warning = plan.reread_warning()
    assert warning.startswith("mmap_weights=True: the planner would not map the 2.58 GiB")
    assert f"re-read ~{reread / 2**20:.0f} MiB/step from disk" in warning
    assert f"at most ~{DISK_READ_BYTES_PER_S / reread:.1f} tok/s per sequence" in warning
    assert f"re-reads ~{fmt_bytes(reread)}" in plan.summary()
    # forcing changes nothing where the anonymous part itself does not fit
    with pytest.raises(InsufficientMemoryError, match="does not fit in memory"):
        plan_memory(dataclasses.replace(mapped, weight_bytes=3 * GiB), tight,
                    PlanLimits(mapped_forced=True, **sizes))


# A Qwen2-7B-shaped Q2_K GGUF (2.58 GiB of blocks mapped) decoding in cgroups of these limits:
# (limit GiB, free GiB when planned, MiB read from disk a decode step: lowest, highest), from
# /proc/self/io read_bytes over 8-token runs (docs/small-machine.md)
MEASURED_REREADS = [(3.49, 3.34, 0, 0), (3.25, 3.09, 0, 0), (3.00, 2.84, 132, 169),
                    (2.88, 2.70, 1026, 1080), (2.75, 2.57, 2406, 2493)]


@pytest.mark.parametrize("limit, free, low, high", MEASURED_REREADS)
def test_reread_estimate_follows_what_was_measured(limit, free, low, high):
    fp = qwen7b_footprint(4, "float32 with GGUF blocks kept")
    mapped = dataclasses.replace(fp, weight_bytes=1 << 20, mapped_bytes=int(2.58 * GiB))
    mem = MemoryInfo(int(limit * GiB), int(free * GiB), f"cgroup v1 limit {limit:.2f} GiB")
    plan = plan_memory(mapped, mem, PlanLimits(block_size=16, max_model_len=None, max_num_seqs=64,
                                               max_num_batched_tokens=512, mapped_forced=True))
    estimate = plan.reread_bytes_per_step() / 2**20
    if high == 0:
        assert estimate == 0
    else:  # within the spread of the runs, give or take a fifth
        assert 0.8 * low <= estimate <= 1.2 * high, estimate
    # what the planner plans for them is more cautious than what decoding finds
    assert plan.page_cache_room() < plan.expected_page_cache()


def test_an_encoder_plans_no_kv_cache(minilm_dir):
    """all-MiniLM-L6-v2: its blocks only count tokens, so the plan holds no KV bytes and fits
    where weights, activations and runtime do (the planner used to set aside 288 MiB of KV
    cache the encoder never allocates); too little for those is still refused."""
    ckpt = resolve_checkpoint(minilm_dir)
    n, source = checkpoint_num_params(ckpt)
    fp = footprint(ckpt.arch, n, 4, "float32", source)
    limits = PlanLimits(block_size=16, max_model_len=256, max_num_seqs=64,
                        max_num_batched_tokens=512, overhead_bytes=256 * 1024 ** 2)
    need = fp.weight_bytes + 256 * 1024 ** 2 + 200 * 1024 ** 2
    plan = plan_memory(fp, MemoryInfo(need, need, "test"), limits)
    assert plan.kv_cache_bytes == 0 and not plan.kv_used
    assert plan.num_blocks == 64 * 256 // 16 and plan.max_model_len == 256
    assert "no KV cache (an encoder attends within each step)" in plan.summary()
    with pytest.raises(InsufficientMemoryError):
        plan_memory(fp, MemoryInfo(fp.weight_bytes, fp.weight_bytes, "test"), limits)
