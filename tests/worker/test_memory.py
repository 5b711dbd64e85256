"""Memory planning from metadata: what fits, what is chosen, and the advice when nothing fits."""
import dataclasses
import json
import math
import time
from pathlib import Path

import pytest

from pagedllm import LLM
from pagedllm.loader.checkpoint import resolve_checkpoint
from pagedllm.loader.metadata import checkpoint_num_params
from pagedllm.platforms.cpu import CpuPlatform
from pagedllm.platforms.interface import MemoryInfo
from pagedllm.worker.memory import (InsufficientMemoryError, footprint,
                                    kv_bytes_per_token, plan_memory)

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
        plan_memory(qwen7b_footprint(), SMALL_VM, block_size=16, max_model_len=None,
                    max_num_seqs=64, max_num_batched_tokens=2048)
    msg = str(err.value)
    assert "needs" in msg and "weights 14.19 GiB" in msg and "7.62 B parameters" in msg
    assert "KV cache" in msg and "2048 tokens" in msg
    assert "cgroup v1 limit 3.49 GiB, 3.10 GiB free" in msg
    assert "4-bit GGUF" in msg and "~4.30 GiB (still too large here)" in msg and "int8" in msg
    assert "smaller model of the same family: Qwen2.5-0.5B-Instruct" in msg
    assert "(Q2_K): weights ~2.79 GiB (still too large here)" in msg


def test_advice_names_the_low_bit_gguf_that_would_fit():
    with pytest.raises(InsufficientMemoryError) as err:  # 4.5 GiB: Q2_K fits, Q3_K_S does not
        plan_memory(qwen7b_footprint(), MemoryInfo(8 * GiB, int(4.5 * GiB), "test"), block_size=16,
                    max_model_len=None, max_num_seqs=64, max_num_batched_tokens=2048)
    msg = str(err.value)
    assert "a 2-bit GGUF of the same model (Q2_K): weights ~2.79 GiB (would fit here)" in msg
    assert ("a 3-bit GGUF of the same model (Q3_K_S): weights ~3.19 GiB (would run here with its "
            "blocks mapped from a file; the page cache holds ~") in msg
    assert "(Q4_K_M): weights ~4.30 GiB (still too large here)" in msg


def test_advice_offers_a_gguf_whose_blocks_the_page_cache_would_mostly_hold():
    vm = MemoryInfo(int(3.49 * GiB), int(3.34 * GiB), "cgroup v1 limit 3.49 GiB, 3.34 GiB free")
    with pytest.raises(InsufficientMemoryError) as err:
        plan_memory(qwen7b_footprint(), vm, block_size=16, max_model_len=None, max_num_seqs=64,
                    max_num_batched_tokens=512)
    msg = str(err.value)
    assert ("(Q2_K): weights ~2.79 GiB (would run here with its blocks mapped from a file; the "
            "page cache holds ~8") in msg
    assert "(Q3_K_S): weights ~3.19 GiB (still too large here)" in msg


def test_a_fitting_model_gets_a_cache_and_the_full_length():
    fp = qwen7b_footprint()
    plan = plan_memory(fp, MemoryInfo(64 * GiB, 60 * GiB, "test"), block_size=16,
                       max_model_len=None, max_num_seqs=8, max_num_batched_tokens=2048)
    assert plan.max_model_len == 32768 and plan.num_blocks * 16 >= 32768
    explicit = plan_memory(fp, MemoryInfo(64 * GiB, 60 * GiB, "test"), block_size=16,
                           max_model_len=4096, max_num_seqs=8, max_num_batched_tokens=2048)
    assert explicit.max_model_len == 4096


def test_limits_are_checked():
    fp = qwen7b_footprint()
    big = MemoryInfo(64 * GiB, 60 * GiB, "test")
    with pytest.raises(ValueError, match="max_model_len=65536 is larger than the model supports"):
        plan_memory(fp, big, block_size=16, max_model_len=65536, max_num_seqs=8,
                    max_num_batched_tokens=2048)
    with pytest.raises(ValueError, match="does not fit the KV cache"):
        plan_memory(fp, big, block_size=16, max_model_len=4096, max_num_seqs=8,
                    max_num_batched_tokens=2048, num_blocks=8)
    with pytest.raises(InsufficientMemoryError):
        plan_memory(fp, big, block_size=16, max_model_len=None, max_num_seqs=8,
                    max_num_batched_tokens=2048, kv_cache_bytes=100 * GiB)


def test_llm_refuses_qwen7b_fast_before_loading(monkeypatch):
    monkeypatch.setattr(CpuPlatform, "memory", lambda self: SMALL_VM)
    started = time.monotonic()
    with pytest.raises(InsufficientMemoryError, match="does not fit in memory"):
        LLM(model=str(QWEN7B), device="cpu")
    assert time.monotonic() - started < 2.0


def test_a_sliding_window_below_the_positions_caps_max_model_len():
    fp = qwen7b_footprint()
    windowed = dataclasses.replace(fp, arch=dataclasses.replace(fp.arch, sliding_window=4096))
    big = MemoryInfo(64 * GiB, 60 * GiB, "test")
    plan = plan_memory(windowed, big, block_size=16, max_model_len=None, max_num_seqs=8,
                       max_num_batched_tokens=2048)
    assert plan.max_model_len == 4096
    with pytest.raises(ValueError, match="max_model_len=8192 is larger than the model supports "
                       r"\(4096 positions: its sliding_window 4096 is below "
                       "max_position_embeddings 32768, and pagedllm has no sliding-window"):
        plan_memory(windowed, big, block_size=16, max_model_len=8192, max_num_seqs=8,
                    max_num_batched_tokens=2048)


# ---- pipeline parallelism: each rank's share ---------------------------------------------
def qwen7b_split_footprint():
    """The Qwen2-7B shapes in bfloat16, with their weights by layer (equal layers from the
    config's shapes: the index has names, no sizes)."""
    from pagedllm.loader.metadata import weight_layout

    ckpt = resolve_checkpoint(QWEN7B)
    n, source = checkpoint_num_params(ckpt)
    return footprint(ckpt.arch, n, 2, "bfloat16", source, layout=weight_layout(ckpt, 2))


def test_stage_shares_are_the_real_tensor_sizes_of_a_gguf(qwen_gguf):
    from pagedllm.distributed.stage import PipelineStage
    from pagedllm.kernels.types import KERNEL_TYPES
    from pagedllm.loader.gguf_header import gguf_header
    from pagedllm.loader.metadata import gguf_weight_bytes, weight_layout

    ckpt = resolve_checkpoint(qwen_gguf)
    layout = weight_layout(ckpt, 4, KERNEL_TYPES)
    assert layout.total == gguf_weight_bytes(ckpt, KERNEL_TYPES, 4)
    tensors = {t.name: t for t in gguf_header(qwen_gguf)[1]}
    layer0 = sum(t.nbytes if t.qtype in KERNEL_TYPES and len(t.shape) == 2
                 else math.prod(t.shape) * 4 for n, t in tensors.items() if n.startswith("blk.0."))
    assert layout.layers[0] == layer0
    assert layout.embedding == tensors["token_embd.weight"].nbytes
    shares = [layout.stage_bytes(s.start_layer, s.end_layer, s.is_first, s.is_last)[0]
              for s in (PipelineStage.of_rank(24, r, 2) for r in range(2))]
    # the shipped GGUF has its own output.weight (Q8_0): the last stage holds it
    assert not layout.tied and sum(shares) == layout.total
    assert layout.head == tensors["output.weight"].nbytes + 896 * 4  # and the final norm
    assert shares[1] - sum(layout.layers[12:]) == layout.head


def test_ranks_on_one_machine_share_it_and_ranks_with_their_own_memory_do_not():
    from pagedllm.worker.memory import plan_pipeline_memory

    fp = qwen7b_split_footprint()  # 14.19 GiB of weights
    ten = MemoryInfo(10 * GiB, 10 * GiB, "test 10 GiB")
    sizes = dict(block_size=16, max_model_len=4096, max_num_seqs=8, max_num_batched_tokens=512)
    with pytest.raises(InsufficientMemoryError, match="does not fit in memory"):
        plan_memory(fp, ten, **sizes)
    with pytest.raises(InsufficientMemoryError) as err:  # two processes here: their sum
        plan_pipeline_memory(fp, 2, ten, None, **sizes)
    assert "2 pipeline ranks on this machine, sharing its memory" in str(err.value)
    assert "runtime 768 MiB" in str(err.value)
    plan = plan_pipeline_memory(fp, 2, ten, [ten, ten], **sizes)  # a machine (cgroup) each
    assert len(plan.ranks) == 2 and plan.max_model_len == 4096
    assert {r.num_blocks for r in plan.ranks} == {plan.num_blocks}
    assert all(r.weight_bytes < 8 * GiB for r in plan.ranks)
    assert sum(r.weight_bytes for r in plan.ranks) == fp.layout.total
    assert "pipeline rank 1 of 2: layers 14-27, head" in plan.summary()
    # a rank whose own memory is short is named
    with pytest.raises(InsufficientMemoryError) as err:
        plan_pipeline_memory(fp, 2, ten, [ten, MemoryInfo(6 * GiB, 6 * GiB, "small")], **sizes)
    assert "(pipeline rank 1 of 2: layers 14-27, head)" in str(err.value)
    assert "available: 6.00 GiB (small)" in str(err.value)


def test_the_advice_counts_the_machines_a_split_would_need():
    from pagedllm.worker.memory import plan_pipeline_memory

    fp = qwen7b_split_footprint()
    sizes = dict(block_size=16, max_model_len=None, max_num_seqs=64, max_num_batched_tokens=2048)
    with pytest.raises(InsufficientMemoryError) as err:
        plan_memory(fp, SMALL_VM, **sizes)
    pp = err.value.machines["pipeline_parallel_size"]
    tp = err.value.machines["tensor_parallel_size"]
    # embedding and head are 1.02 GiB each in bfloat16, and the logits of 64 sequences 0.58 GiB
    assert pp is not None and tp is not None and 5 <= tp <= pp
    assert f"pipeline_parallel_size={pp} or tensor_parallel_size={tp} " in str(err.value)
    assert f"split over {tp}+ machines like this one" in str(err.value)
    # the count is the smallest split whose every rank fits a machine like this one
    plan_pipeline_memory(fp, pp, SMALL_VM, [SMALL_VM] * pp, **sizes)
    with pytest.raises(InsufficientMemoryError):
        plan_pipeline_memory(fp, pp - 1, SMALL_VM, [SMALL_VM] * (pp - 1), **sizes)


def test_mapped_blocks_are_refused_when_the_page_cache_would_hold_too_few():
    from pagedllm.worker.memory import MAPPED_MIN_SHARE

    fp = qwen7b_footprint()
    sizes = dict(block_size=16, max_model_len=None, max_num_seqs=8, max_num_batched_tokens=512)
    # 4 GiB of blocks mapped (bfloat16 norms stay), in 3.49 GiB: the page cache holds < 75 %
    mapped = dataclasses.replace(fp, weight_bytes=fp.weight_bytes - 4 * GiB,
                                 mapped_bytes=4 * GiB)
    mapped = dataclasses.replace(mapped, weight_bytes=64 * 1024 ** 2)
    with pytest.raises(InsufficientMemoryError) as err:
        plan_memory(mapped, SMALL_VM, **sizes)
    assert err.value.page_cache and f"pagedllm maps them from {MAPPED_MIN_SHARE:.0%}" in str(
        err.value)
    # 2 GiB of them: the page cache holds them all
    plan = plan_memory(dataclasses.replace(mapped, mapped_bytes=2 * GiB), SMALL_VM, **sizes)
    assert plan.page_cache_room() >= 2 * GiB
