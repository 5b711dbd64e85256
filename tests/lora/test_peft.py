"""Reading PEFT adapters: rank and scale from adapter_config.json, tensors checked against the
base model's shapes, and what the engine cannot apply refused by name (files written by hand
on a toy architecture; tests/e2e/test_lora.py runs adapters that peft made)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pagedllm.config import LoRAConfig, ModelArchConfig
from pagedllm.lora.peft import check_adapter, load_adapter
from pagedllm.lora.registry import AdapterRegistry
from pagedllm.lora.request import LoRARequest

ARCH = ModelArchConfig(architecture="llama", vocab_size=64, hidden_size=32, intermediate_size=48,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0,
                       max_position_embeddings=128, tie_word_embeddings=False,
                       attention_bias=False)
PREFIX = "base_model.model.model.layers"


def _key(layer: int, module: str, half: str) -> str:
    block = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
    return f"{PREFIX}.{layer}.{block}.{module}.lora_{half}.weight"


def write_adapter(path: Path, r: int = 4, config: dict | None = None,
                  tensors: dict[str, torch.Tensor] | None = None) -> LoRARequest:
    """A PEFT-layout adapter on q_proj (32 -> 32) and down_proj (48 -> 32) of layer 1."""
    path.mkdir(parents=True, exist_ok=True)
    cfg = {"peft_type": "LORA", "r": r, "lora_alpha": 8, "target_modules": ["q_proj", "down_proj"],
           "bias": "none", "modules_to_save": None, "use_dora": False, "use_rslora": False}
    cfg.update(config or {})
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    if tensors is None:
        tensors = {_key(1, "q_proj", "A"): torch.randn(r, 32),
                   _key(1, "q_proj", "B"): torch.randn(32, r),
                   _key(1, "down_proj", "A"): torch.randn(r, 48),
                   _key(1, "down_proj", "B"): torch.randn(32, r)}
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return LoRARequest(path.name, 1, str(path))


def test_rank_scale_and_matrices(tmp_path):
    request = write_adapter(tmp_path / "plain")
    adapter = load_adapter(request, ARCH, max_rank=8)
    assert (adapter.config.rank, adapter.config.scale) == (4, 2.0)  # lora_alpha / r
    assert sorted(adapter.weights) == [(1, "down_proj"), (1, "q_proj")]
    a, b = adapter.weights[(1, "down_proj")]
    assert a.shape == (4, 48) and b.shape == (32, 4) and a.dtype == torch.float32
    rs = write_adapter(tmp_path / "rs", config={"use_rslora": True})
    assert check_adapter(rs, ARCH, 8).scale == 8 / math.sqrt(4)  # rsLoRA: lora_alpha / sqrt(r)


@pytest.mark.parametrize("field, value", [
    ("modules_to_save", ["lm_head"]), ("use_dora", True), ("bias", "all"),
    ("fan_in_fan_out", True), ("rank_pattern", {"q_proj": 2}), ("peft_type", "LOHA"),
    ("trainable_token_indices", [1, 2])])
def test_what_the_engine_cannot_apply_is_refused_by_name(tmp_path, field, value):
    request = write_adapter(tmp_path / "a", config={field: value})
    with pytest.raises(ValueError, match=field):
        check_adapter(request, ARCH, 8)


def test_rank_over_max_lora_rank_is_refused(tmp_path):
    request = write_adapter(tmp_path / "a", r=16)
    with pytest.raises(ValueError, match="r=16 is over max_lora_rank=8"):
        check_adapter(request, ARCH, 8)


def test_embedding_and_head_targets_are_refused(tmp_path):
    request = write_adapter(tmp_path / "a", config={"target_modules": ["q_proj", "embed_tokens"]})
    with pytest.raises(ValueError, match="target_modules \\['embed_tokens'\\]"):
        check_adapter(request, ARCH, 8)
    key = "base_model.model.lm_head.lora_A.weight"
    request = write_adapter(tmp_path / "b", config={"target_modules": "all-linear"},
                            tensors={key: torch.zeros(4, 32)})
    with pytest.raises(ValueError, match=f"tensor '{key}' targets embeddings or the output head"):
        check_adapter(request, ARCH, 8)


def test_a_shape_of_another_base_model_names_the_tensor(tmp_path):
    key = _key(0, "k_proj", "B")
    request = write_adapter(tmp_path / "a", tensors={_key(0, "k_proj", "A"): torch.zeros(4, 32),
                                                     key: torch.zeros(32, 4)})
    with pytest.raises(ValueError, match=f"tensor '{key}' has shape \\[32, 4\\], but the base "
                                         "model's k_proj \\(r=4\\) needs \\[16, 4\\]"):
        check_adapter(request, ARCH, 8)


def test_a_layer_beyond_the_base_and_a_missing_half_are_refused(tmp_path):
    key = _key(5, "q_proj", "A")
    request = write_adapter(tmp_path / "a", tensors={key: torch.zeros(4, 32)})
    with pytest.raises(ValueError, match="is for layer 5, but the base model has 2 layers"):
        check_adapter(request, ARCH, 8)
    request = write_adapter(tmp_path / "b", tensors={_key(0, "q_proj", "A"): torch.zeros(4, 32)})
    with pytest.raises(ValueError, match="layer 0's q_proj has no lora_B tensor"):
        check_adapter(request, ARCH, 8)


def test_a_path_without_an_adapter_is_refused(tmp_path):
    with pytest.raises(ValueError, match="lora_path .* is not a local directory"):
        check_adapter(LoRARequest("x", 1, str(tmp_path / "missing")), ARCH, 8)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "adapter_config.json").write_text(json.dumps({"r": 4}))
    with pytest.raises(ValueError, match="has no adapter_model.safetensors"):
        check_adapter(LoRARequest("x", 1, str(tmp_path / "bin")), ARCH, 8)


def test_the_registry_refuses_without_enable_lora_and_a_reused_id(tmp_path):
    request = write_adapter(tmp_path / "a")
    with pytest.raises(ValueError, match="lora_request needs an engine started with "
                                         "enable_lora=True"):
        AdapterRegistry(ARCH, None, check_adapter).check(request)
    registry = AdapterRegistry(ARCH, LoRAConfig(max_lora_rank=8), check_adapter)
    assert registry.check(None) is None and registry.check(request) is request
    other = write_adapter(tmp_path / "b")
    with pytest.raises(ValueError, match="lora_int_id=1 already names the adapter"):
        registry.check(other)
    with pytest.raises(ValueError, match="lora_request must be a LoRARequest"):
        registry.check({"lora_name": "a"})


def test_lora_request_checks_its_fields_and_has_vllms_aliases():
    from pagedllm import LoRARequest as exported
    assert exported is LoRARequest
    r = LoRARequest("sql", 3, "/adapters/sql")
    assert (r.name, r.adapter_id, r.path) == ("sql", 3, "/adapters/sql")
    for bad, field in [(("", 1, "/p"), "lora_name"), (("a", 0, "/p"), "lora_int_id"),
                       (("a", True, "/p"), "lora_int_id"), (("a", 1, ""), "lora_path")]:
        with pytest.raises(ValueError, match=f"lora_request.{field}"):
            LoRARequest(*bad)
