"""What each weight format of an HF checkpoint costs: bytes from the tensor table, the bandwidth
bound, and the measured table attached only to the model it was measured on."""
from __future__ import annotations

import pytest

from pagedllm.engine.config_builder import weight_format_costs
from pagedllm.loader.checkpoint import resolve_checkpoint
from pagedllm.memory import weight_formats as wf
from pagedllm.memory.head_screen import ENV, screen_bytes
from pagedllm.memory.weight_layout import weight_layout


def test_bytes_follow_the_block_formats(qwen_hf_dir):
    ckpt = resolve_checkpoint(qwen_hf_dir)
    costs = weight_format_costs(ckpt)
    values = weight_layout(ckpt, 1).total
    assert costs["fp32"].weight_bytes == 4 * values and costs["bf16"].weight_bytes == 2 * values
    assert costs["int8"].weight_bytes == pytest.approx(values * 34 / 32, rel=1e-6)
    # int4: matrices in Q4_1, the embedding and head kept in Q8_0
    assert costs["int8"].weight_bytes > costs["int4"].weight_bytes > values * 20 / 32
    # made slice by slice at load, then regrouped for the kernels: the blocks twice
    assert costs["int8"].load_peak_bytes == 2 * costs["int8"].weight_bytes
    assert costs["bf16"].load_peak_bytes == costs["bf16"].weight_bytes
    # bf16 regrouped for pagedllm's kernels: bf16's bytes, made at load like int8, and the
    # greedy head's int8 screen, which a greedy step reads instead of the bf16 head
    screen = costs["bf16x8"].screen_bytes
    assert screen == screen_bytes(ckpt.arch) > 0
    assert costs["bf16x8"].weight_bytes == costs["bf16"].weight_bytes + screen
    head = weight_layout(ckpt, 2).head
    assert costs["bf16x8"].step_bytes == costs["bf16"].step_bytes - head + screen
    assert "with the greedy head's int8 screen" in costs["bf16x8"].describe()
    # regrouped one matrix at a time: the peak holds the largest part twice, not all
    assert (costs["bf16x8"].weight_bytes < costs["bf16x8"].load_peak_bytes
            < 1.5 * costs["bf16x8"].weight_bytes)
    # an untied head: a decode step reads the head, not the embedding matrix
    layout = weight_layout(ckpt, 4)
    assert not layout.tied and costs["fp32"].step_bytes == layout.total - layout.embedding
    for cost in costs.values():
        assert cost.decode_bound_tok_per_s == pytest.approx(wf.READ_BYTES_PER_S / cost.step_bytes)


def test_without_the_screen_bf16x8_holds_bf16s_bytes(qwen_hf_dir, monkeypatch):
    monkeypatch.setenv(ENV, "0")
    costs = weight_format_costs(resolve_checkpoint(qwen_hf_dir))
    assert costs["bf16x8"].screen_bytes == 0
    assert costs["bf16x8"].weight_bytes == costs["bf16"].weight_bytes
    assert costs["bf16x8"].step_bytes == costs["bf16"].step_bytes


def test_measured_figures_belong_to_the_measured_model_only(qwen_hf_dir, smollm_hf_dir):
    qwen = weight_format_costs(resolve_checkpoint(qwen_hf_dir))
    assert qwen["int8"].measured is not None and qwen["bf16"].measured is not None
    smollm = weight_format_costs(resolve_checkpoint(smollm_hf_dir))
    assert all(c.measured is None for c in smollm.values())
    line = wf.format_summary(smollm, "bf16")
    assert line.startswith('weight format bf16 (dtype="bfloat16", quantization="none"): weights ')
    assert 'instead int8 (quantization="int8")' in line
    assert "measured " not in line and "perplexity" not in line  # nothing claimed for it


def test_engine_settings_name_their_format():
    assert wf.format_of("bfloat16", "none") == "bf16"
    assert wf.format_of("float32", "none") == "fp32"
    assert wf.format_of("float32", "int8") == "int8" and wf.format_of("float32", "int4") == "int4"
    assert wf.format_of("float32", "gguf") is None and wf.format_of("float16", "none") is None
