"""HF safetensors loading, config.json translation and checkpoint resolution."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from pagedllm.loader.checkpoint import generation_config, load_weights, resolve_checkpoint
from pagedllm.loader.hf.arch import arch_from_hf_config
from pagedllm.loader.hf.safetensors_loader import INDEX_FILE, load_safetensors_weights
from pagedllm.tokenizer.tokenizer import load_tokenizer

LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32,
    "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
    "max_position_embeddings": 64, "eos_token_id": [2, 3], "bos_token_id": 1,
}


@pytest.mark.parametrize("which", ["qwen", "smollm"])
def test_hf_dir_loads_what_transformers_saved(which, qwen_hf_dir, smollm_hf_dir):
    # tests/loader/gguf/test_weights.py shows the GGUF load equals these files, so both paths
    # give the same tensors.
    hf_dir = {"qwen": qwen_hf_dir, "smollm": smollm_hf_dir}[which]
    ckpt = resolve_checkpoint(hf_dir)
    assert (ckpt.kind, ckpt.path, ckpt.tokenizer_path) == ("safetensors", hf_dir, hf_dir)
    assert (hf_dir / INDEX_FILE).is_file() == (which == "smollm")  # one sharded, one single-file
    files = sorted(hf_dir.glob("*.safetensors"))
    # the default model into bf16 (converted as it loads): its float32 copy beside pytest's own
    # memory was the suite's peak (3.6 GiB); SmolLM2 checks the float32 load bit for bit
    dtype = torch.bfloat16 if which == "qwen" else torch.float32
    params = {}
    for file in files:  # shapes and dtypes only: the data is read one tensor at a time below
        with safe_open(str(file), "pt") as fh:
            for name in fh.keys():
                piece = fh.get_slice(name)
                params[name] = torch.empty(piece.get_shape(), dtype=dtype)
                assert piece.get_dtype() == "F32", name
    load_weights(ckpt, params)
    for name in params:  # the file's map closes after each tensor: its pages leave the RSS
        for file in files:
            with safe_open(str(file), "pt") as fh:
                if name in fh.keys():
                    assert torch.equal(params[name], fh.get_tensor(name).to(dtype)), name
    assert generation_config(ckpt)["eos_token_id"] == ckpt.arch.eos_token_ids[0]


def test_hf_tokenizer_matches_gguf_metadata(smollm_hf_dir):
    tok = load_tokenizer(smollm_hf_dir)
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert "<|im_start|>" in tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)


def _write_tiny(dir_: Path, tensors: dict[str, torch.Tensor], config: dict = LLAMA_CONFIG) -> Path:
    """A tiny HF dir: config.json plus one model.safetensors."""
    dir_.mkdir(parents=True, exist_ok=True)
    (dir_ / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(dir_ / "model.safetensors"))
    return dir_


def test_tied_lm_head_skipped_or_filled_and_inv_freq_ignored(tmp_path):
    embed = torch.randn(32, 8)
    src = _write_tiny(tmp_path / "m", {
        "model.embed_tokens.weight": embed, "lm_head.weight": embed.clone(),
        "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(2)})
    tied = {"model.embed_tokens.weight": torch.empty(32, 8, dtype=torch.bfloat16)}
    load_safetensors_weights(src, tied)
    assert torch.equal(tied["model.embed_tokens.weight"], embed.to(torch.bfloat16))
    no_head = _write_tiny(tmp_path / "n", {"model.embed_tokens.weight": embed})
    untied = {"model.embed_tokens.weight": torch.empty(32, 8), "lm_head.weight": torch.empty(32, 8)}
    load_safetensors_weights(no_head, untied)
    assert torch.equal(untied["lm_head.weight"], embed)


def test_big_tensor_copied_in_chunks(tmp_path, monkeypatch):
    import pagedllm.loader.hf.safetensors_loader as loader

    monkeypatch.setattr(loader, "CHUNK_ELEMENTS", 40)  # 5 rows of 8 per slice
    embed = torch.randn(32, 8)
    dest = {"model.embed_tokens.weight": torch.empty(32, 8)}
    load_safetensors_weights(_write_tiny(tmp_path, {"model.embed_tokens.weight": embed}), dest)
    assert torch.equal(dest["model.embed_tokens.weight"], embed)


def test_fused_tensors_split_into_the_shards_in_chunks(tmp_path, monkeypatch):
    import pagedllm.loader.hf.safetensors_loader as loader

    monkeypatch.setattr(loader, "CHUNK_ELEMENTS", 40)  # 5 rows of 8 per slice
    qkv = torch.randn(24, 8)  # Phi-3's fused q (12 rows), k (6), v (6)
    src = _write_tiny(tmp_path, {"model.layers.0.self_attn.qkv_proj.weight": qkv})
    merged = torch.empty(24, 8)  # a MergedLinear's weight and its shards' row views
    params = {f"model.layers.0.self_attn.{n}.weight": merged[a:b]
              for n, a, b in (("q_proj", 0, 12), ("k_proj", 12, 18), ("v_proj", 18, 24))}
    load_safetensors_weights(src, params)
    assert torch.equal(merged, qkv)
    params["model.layers.0.self_attn.v_proj.weight"] = torch.empty(7, 8)
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.qkv_proj\.weight' has "
                       r"shape \(24, 8\) but its shards .* take \(25, 8\)"):
        load_safetensors_weights(src, params)


def test_a_tensor_parallel_rank_reads_its_rows_of_each_fused_shard(tmp_path):
    """Rank 1 of 2: q rows [6, 12), k rows [15, 18), v rows [21, 24) of the fused qkv_proj (in
    chunks); a shard split along its columns is refused with the fused tensor named."""
    from pagedllm.shard import Shard

    qkv = torch.randn(24, 8)
    src = _write_tiny(tmp_path, {"model.layers.0.self_attn.qkv_proj.weight": qkv})
    merged = torch.empty(12, 8)
    names = [f"model.layers.0.self_attn.{n}.weight" for n in ("q_proj", "k_proj", "v_proj")]
    params = {names[0]: merged[0:6], names[1]: merged[6:9], names[2]: merged[9:12]}
    shards = {names[0]: Shard(0, 6, 6, 12), names[1]: Shard(0, 3, 3, 6),
              names[2]: Shard(0, 3, 3, 6)}
    load_safetensors_weights(src, params, shards=shards)
    assert torch.equal(merged, torch.cat([qkv[6:12], qkv[15:18], qkv[21:24]]))
    shards[names[1]] = Shard(1, 4, 4, 8)
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.qkv_proj\.weight' "
                       r"is fused, and tensor parallelism splits its shard "
                       r"'model\.layers\.0\.self_attn\.k_proj\.weight' along the reduction"):
        load_safetensors_weights(src, params, shards=shards)


def test_missing_unexpected_and_misshaped_are_named(tmp_path):
    src = _write_tiny(tmp_path, {"model.embed_tokens.weight": torch.zeros(32, 8),
                                 "model.extra.weight": torch.zeros(2)})
    params = {"model.embed_tokens.weight": torch.empty(32, 8), "model.norm.weight": torch.empty(8)}
    with pytest.raises(ValueError, match=r"missing tensors \['model\.norm\.weight'\].*'model\.extra\.weight'"):
        load_safetensors_weights(src, params)
    with pytest.raises(ValueError, match=r"model\.embed_tokens\.weight.*\(32, 8\)"):
        load_safetensors_weights(src, {"model.embed_tokens.weight": torch.empty(31, 8),
                                       "model.extra.weight": torch.empty(2)})


def test_unknown_architecture_in_copied_config(tmp_path, smollm_hf_dir):
    cfg = json.loads((smollm_hf_dir / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    for shard in smollm_hf_dir.glob("*.safetensors"):
        (tmp_path / shard.name).symlink_to(shard)
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*LlamaForCausalLM.*Qwen2ForCausalLM"):
        resolve_checkpoint(tmp_path)


def test_resolve_checkpoint_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_checkpoint(tmp_path / "nope")
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_CONFIG))
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="safetensors"):
        resolve_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="not a .gguf"):
        resolve_checkpoint(tmp_path / "config.json")


def test_hf_config_rope_parameters_and_legacy_keys():
    new = arch_from_hf_config(dict(LLAMA_CONFIG, rope_parameters={
        "rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0}))
    assert new.rope_theta == 500000.0
    assert new.rope_scaling == {"rope_type": "llama3", "factor": 8.0}
    plain = arch_from_hf_config(dict(LLAMA_CONFIG, rope_parameters={"rope_theta": 1e6, "rope_type": "default"}))
    assert (plain.rope_theta, plain.rope_scaling) == (1e6, None)
    legacy = arch_from_hf_config(dict(LLAMA_CONFIG, rope_theta=1e4, rope_scaling={"type": "linear", "factor": 2.0}))
    assert legacy.rope_scaling == {"type": "linear", "rope_type": "linear", "factor": 2.0}
    assert (legacy.head_dim, legacy.num_key_value_heads, legacy.eos_token_ids) == (4, 2, (2, 3))
    assert not legacy.tie_word_embeddings and not legacy.attention_bias
    qwen = arch_from_hf_config({k: v for k, v in LLAMA_CONFIG.items() if k != "architectures"}
                               | {"model_type": "qwen2", "eos_token_id": 7})
    assert (qwen.architecture, qwen.attention_bias, qwen.eos_token_ids, qwen.rope_theta) == ("qwen2", True, (7,), 10000.0)
    with pytest.raises(ValueError, match="'hidden_size'"):
        arch_from_hf_config({k: v for k, v in LLAMA_CONFIG.items() if k != "hidden_size"})
