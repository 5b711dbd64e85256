"""Rotary embeddings: inverse frequencies and scale match HF transformers for every scaling type."""
import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from pagedllm.layers.rotary import RotaryEmbedding, rope_inv_freq

CASES = [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
     "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.707},
]


@pytest.mark.parametrize("scaling", CASES, ids=lambda s: s["rope_type"])
def test_scaled_inv_freq_matches_transformers(scaling):
    theta, head_dim, max_pos = 1_000_000.0, 64, 131072
    cfg = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                      max_position_embeddings=max_pos,
                      rope_parameters={"rope_theta": theta, **scaling})
    ref_freq, ref_scale = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](cfg, "cpu")
    freq, scale = rope_inv_freq(theta, head_dim, dict(scaling), max_pos)
    torch.testing.assert_close(freq, ref_freq.float(), rtol=1e-6, atol=0)
    assert scale == pytest.approx(ref_scale)


def test_rotation_is_rotate_half_layout_and_keeps_norms():
    rope = RotaryEmbedding(8, 16, 10000.0)
    q, k = torch.randn(3, 2, 8), torch.randn(3, 1, 8)
    pos = torch.tensor([0, 5, 15])
    q2, k2 = rope(pos, q, k)
    torch.testing.assert_close(q2[0], q[0])  # position 0 is the identity
    torch.testing.assert_close(q2.norm(dim=-1), q.norm(dim=-1))
    torch.testing.assert_close(k2.norm(dim=-1), k.norm(dim=-1))


def test_unknown_scaling_type_is_a_clear_error():
    with pytest.raises(ValueError, match="rope_scaling type 'ntk-magic' is not supported"):
        rope_inv_freq(10000.0, 64, {"rope_type": "ntk-magic", "factor": 2.0}, 4096)


@pytest.mark.parametrize("context_len", [4096, 131072], ids=["short", "long"])
def test_longrope_matches_transformers_on_each_side_of_the_original_context(context_len):
    from transformers import Phi3Config

    head_dim, gen = 32, torch.Generator().manual_seed(0)
    scaling = {"rope_type": "longrope", "rope_theta": 10000.0,
               "short_factor": (1 + torch.rand(16, generator=gen)).tolist(),
               "long_factor": (1 + 8 * torch.rand(16, generator=gen)).tolist()}
    cfg = Phi3Config(hidden_size=head_dim * 4, num_attention_heads=4, pad_token_id=None,
                     max_position_embeddings=131072, original_max_position_embeddings=4096,
                     rope_parameters=dict(scaling))
    ref_freq, ref_scale = ROPE_INIT_FUNCTIONS["longrope"](cfg, "cpu", seq_len=context_len)
    ours = dict(scaling, original_max_position_embeddings=4096)
    freq, scale = rope_inv_freq(10000.0, head_dim, ours, 131072, context_len)
    torch.testing.assert_close(freq, ref_freq.float(), rtol=0, atol=0)
    assert scale == pytest.approx(ref_scale) and scale > 1
