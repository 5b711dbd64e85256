"""The refusal's ways out: every weight format, each planned by the planner itself on machines
like this one, machine counts equal to the sizes printed, TP sizes the shapes split into, the
tested way (a Q4_K_M GGUF over two machines) first, and the bandwidth model's speeds."""
import re
from pathlib import Path

import pytest
import torch

from pagedllm.distributed.stage import even_partition
from pagedllm.loader.checkpoint import resolve_checkpoint
from pagedllm.hub.hub import parse_hub_ref
from pagedllm.loader.metadata import checkpoint_num_params
from pagedllm.memory.advice import (FORMATS, format_footprints, format_layout, gguf_hub_ref,
                                    tp_sizes)
from pagedllm.memory.advice_text import advise
from pagedllm.memory.decode_speed import (MESSAGE_SECONDS, WEIGHT_READ_BYTES_PER_S,
                                          pipeline_tok_per_s, rank_seconds,
                                          tensor_parallel_tok_per_s)
from pagedllm.memory.footprint import footprint
from pagedllm.memory.plan import (DISK_READ_BYTES_PER_S, InsufficientMemoryError, PlanLimits,
                                  plan_memory, plan_pipeline_memory)
from pagedllm.memory.weight_layout import planned_weight_layout
from pagedllm.platforms.interface import MemoryInfo

GiB = 1024 ** 3
DATA = Path(__file__).resolve().parents[1] / "data"
QWEN7B = DATA / "qwen2-7b-instruct-shapes"
# the seed user's VM as doctor saw it in a 3.49 GiB cgroup v1 (docs/memory.md)
SEED_VM = MemoryInfo(3_750_588_416, int(3.33 * GiB), "cgroup v1 limit 3.49 GiB, 3.33 GiB free")
SIZES = dict(block_size=16, max_model_len=None, max_num_seqs=64, max_num_batched_tokens=512)


def refusal(path: Path = QWEN7B, mem: MemoryInfo = SEED_VM) -> InsufficientMemoryError:
    """The planner's refusal of the checkpoint at path in bf16, as the engine plans it."""
    ckpt = resolve_checkpoint(path)
    n, source = checkpoint_num_params(ckpt)
    fp = footprint(ckpt.arch, n, 2, "bfloat16", source, None, 0,
                   planned_weight_layout(ckpt, frozenset(), "none", 2))
    with pytest.raises(InsufficientMemoryError) as err:
        plan_memory(fp, mem, PlanLimits(**SIZES), advisor=advise)
    return err.value


def ways_out(err: InsufficientMemoryError) -> list[str]:
    lines = str(err).split("\n")
    return lines[next(i for i, t in enumerate(lines) if t.startswith("ways out")) + 1:]


def test_without_an_advisor_a_refusal_says_why_and_no_ways():
    """The planner alone (as the advice plans its ways) names the shortfall; the advisor the
    caller passes adds the ways out, over the same Shortfall."""
    ckpt = resolve_checkpoint(QWEN7B)
    n, source = checkpoint_num_params(ckpt)
    fp = footprint(ckpt.arch, n, 2, "bfloat16", source, None, 0,
                   planned_weight_layout(ckpt, frozenset(), "none", 2))
    with pytest.raises(InsufficientMemoryError) as bare:
        plan_memory(fp, SEED_VM, PlanLimits(**SIZES))
    text = str(bare.value)
    assert text.startswith("the model does not fit in memory: it needs ")
    assert "available: 3.33 GiB (cgroup v1 limit 3.49 GiB" in text and "ways out" not in text
    assert bare.value.ways == () and bare.value.machines == {}
    advised = advise(bare.value.shortfall)
    assert str(advised).startswith(text + "\nways out: ")
    assert str(advised) == str(refusal()) and len(advised.ways) == len(FORMATS)


def test_the_engines_own_refusal_carries_the_ways(monkeypatch):
    """config_builder passes the advisor: LLM/serve/doctor refusals have the ways out, also
    where float32 (this CPU's default without native bf16) fell back to bf16 first."""
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.engine.config_builder import plan_engine_memory
    from pagedllm.platforms.cpu import CpuPlatform

    monkeypatch.setattr(CpuPlatform, "memory", lambda self: SEED_VM)
    ckpt = resolve_checkpoint(QWEN7B)
    platform = CpuPlatform()
    with pytest.raises(InsufficientMemoryError) as err:
        plan_engine_memory(EngineArgs(model=str(QWEN7B)), ckpt, platform, torch.float32, "none")
    assert "  (float32, this device's default, needs twice the weights)" in str(err.value)
    assert ways_out(err.value)[0].startswith("  - the tested way: a Q4_K_M GGUF")
    assert len(err.value.ways) == len(FORMATS) and err.value.shortfall is not None


def test_the_tested_way_comes_first_with_where_to_get_it():
    lines = ways_out(refusal())
    assert lines[0].startswith("  - the tested way: a Q4_K_M GGUF with pipeline_parallel_size=2 "
                               "over two machines like this one (one rank each")
    assert "pagedllm serve Qwen/Qwen2-7B-Instruct-GGUF:Q4_K_M -pp 2" in lines[0]
    ref = parse_hub_ref("Qwen/Qwen2-7B-Instruct-GGUF:Q4_K_M")  # the form locate_model accepts
    assert (ref.repo_id, ref.quant_tag) == ("Qwen/Qwen2-7B-Instruct-GGUF", "Q4_K_M")
    assert re.search(r"~\d+\.\d tok/s", lines[0])


def test_every_format_has_one_line_fastest_first():
    err = refusal()
    lines = ways_out(err)
    for f in FORMATS:
        assert sum(line.startswith(f"  - {f.label}") for line in lines) == 1, f.label
    # after the tested way, by expected speed
    assert "  - a 2-bit GGUF (Q2_K), weights ~2.83 GiB: fits on this machine, its blocks mapped " \
           "from a file" in "\n".join(lines)
    # each line's best way (a line may offer pipeline and tensor parallel sizes)
    shown = [max(map(float, found)) for line in lines[1:6]
             if (found := re.findall(r"~([\d.]+) tok/s", line))]
    assert shown == sorted(shown, reverse=True)
    # int8/int4 at load are planned as their blocks, held twice at the load's peak (regrouped)
    assert ("int8 at load (quantization='int8': Q8_0 blocks), weights ~7.54 GiB (made at load "
            "slice by slice, then regrouped: the load peaks near ~15.07 GiB)") in str(err)


def test_machine_counts_agree_with_the_sizes_printed():
    text = str(refusal())
    assert "+ machines" not in text
    pairs = re.findall(r"(pipeline|tensor)_parallel_size=(\d+) over (\d+|two) machines", text)
    assert len(pairs) >= 3
    for _, size, count in pairs:
        assert int(size) == (2 if count == "two" else int(count))


def test_offered_tp_sizes_divide_the_heads_and_kv_heads():
    arch = resolve_checkpoint(QWEN7B).arch  # 28 heads, 4 KV heads
    assert tp_sizes(arch) == (2, 4)
    text = str(refusal())
    assert "tensor_parallel_size=6" not in text
    for size in map(int, re.findall(r"tensor_parallel_size=(\d+)", text)):
        assert 28 % size == 0 and 4 % size == 0
    assert "no tensor_parallel_size that splits its 28 heads and 4 KV heads (2, 4) fits" in text
    for size in map(int, re.findall(r"pipeline_parallel_size=(\d+)", text)):
        assert 2 <= size <= arch.num_hidden_layers
    small = resolve_checkpoint(DATA / "qwen2.5-0.5b-instruct-shapes").arch  # 14 heads, 2 KV
    assert tp_sizes(small) == (2,) and tp_sizes(small, block=256) == (2,)


@pytest.mark.parametrize("name", ["Q4_K_M", "bf16"])
def test_each_split_offered_is_the_fewest_ranks_the_planner_fits(name):
    err = refusal()
    fmt = next(f for f in FORMATS if f.name == name)
    ways = next(w for w in err.ways if w.fmt.name == name)
    arch = resolve_checkpoint(QWEN7B).arch
    fps = format_footprints(arch, 7_615_616_512, fmt, "test")

    def fits(pp: int, tp: int = 1) -> bool:
        for fp in fps:
            try:
                plan_pipeline_memory(fp, pp, SEED_VM, PlanLimits(
                    max_model_len=2048, **{k: v for k, v in SIZES.items()
                                           if k != "max_model_len"}),
                    [SEED_VM] * (pp * tp), tp, even_partition(arch.num_hidden_layers, pp))
                return True
            except InsufficientMemoryError:
                pass
        return False

    n = ways.pp.pipeline_parallel_size
    assert ways.one is None and fits(n) and not fits(n - 1)
    if name == "bf16":  # the checkpoint's own split (its real tensor table) says the same
        assert err.machines == {"pipeline_parallel_size": n, "tensor_parallel_size": None}
    if name == "Q4_K_M":
        assert n == 2 and ways.pp.mapped  # as test_small_machine's real Q4_K GGUF runs
        assert ways.tp.tensor_parallel_size == 2 and fits(1, 2)


def test_a_q4_k_m_that_fits_one_machine_is_the_tested_way_there():
    vm = MemoryInfo(8 * GiB, int(7.8 * GiB), "8 GiB")
    lines = ways_out(refusal(mem=vm))
    assert lines[0].startswith("  - the tested way: a Q4_K_M GGUF, fits on this machine")
    assert "-pp" not in lines[0]


def test_gguf_sizes_follow_the_published_files():
    arch = resolve_checkpoint(QWEN7B).arch
    by = {f.name: f for f in FORMATS}
    # Qwen2-7B-Instruct's q4_k_m and q2_k files: 4.68 GB and 3.02 GB
    assert abs(format_layout(arch, by["Q4_K_M"]).total / 4.68e9 - 1) < 0.03
    assert abs(format_layout(arch, by["Q2_K"]).total / 3.02e9 - 1) < 0.03
    # int8 at load is planned as the Q8_0 blocks it runs with (made slice by slice as it loads)
    assert format_layout(arch, by["int8"]).total == pytest.approx(
        7_615_616_512 * 8.5 / 8, rel=0.01)
    assert gguf_hub_ref(arch, "Q2_K") == "Qwen/Qwen2-7B-Instruct-GGUF:Q2_K"
    assert gguf_hub_ref(resolve_checkpoint(DATA / "qwen2.5-3b-instruct-shapes").arch,
                        "Q4_K_M") is None


def test_the_bandwidth_model():
    assert rank_seconds(WEIGHT_READ_BYTES_PER_S) == pytest.approx(1.0)
    assert rank_seconds(0, DISK_READ_BYTES_PER_S) == pytest.approx(1.0)
    # one sequence passes the stages in turn: their times add, plus a message a hop
    assert pipeline_tok_per_s([0.1, 0.1]) == pytest.approx(1 / (0.2 + MESSAGE_SECONDS))
    assert pipeline_tok_per_s([0.2]) == pytest.approx(5.0)
    # tensor parallel ranks run at once: the slowest, plus 1 + 2 all-reduces a layer
    assert tensor_parallel_tok_per_s(0.1, 28) == pytest.approx(1 / (0.1 + 57 * MESSAGE_SECONDS))


def test_readme_and_docs_tables_are_the_planners():
    """README's and docs/memory.md's "what runs where" tables are what the script prints now."""
    import importlib.util

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("what_runs_where",
                                                  root / "scripts" / "what_runs_where.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    table = script.markdown(script.table())
    assert table.startswith("| model | 2 vCPU, 3.49 GiB | 8 GiB | 32 GiB |")
    assert "| Qwen2-7B (7.62 B) | Q4_K_M -pp 2 ~" in table
    for page in ("README.md", "docs/memory.md"):
        assert table in (root / page).read_text(), f"{page}: rerun scripts/what_runs_where.py"
