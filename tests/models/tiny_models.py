"""Tiny random-weight models of each family, for comparing pagedllm with HF transformers.

A model is built with transformers' own classes, saved as an HF directory (safetensors,
config.json and a byte-level tokenizer), and written again as GGUFs of the same tensors with the
`gguf` package, named by llama.cpp's converter map (gguf.get_tensor_name_map), in float32 and
with every matrix in Q8_0 blocks. The reference is transformers itself, in float32: the last
prompt position's logits and 32 greedy tokens per prompt.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Optional

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from e2e.helpers import last_logits, model_runner
from pagedllm import LLM, SamplingParams
from pagedllm.layers.moe import route

VOCAB = 320
NUM_TOKENS = 32
EOS = "<|endoftext|>"
F32, Q8_0 = GGMLQuantizationType.F32, GGMLQuantizationType.Q8_0
# Q8_0 blocks run with 8-bit activations (as ggml's): logits within this share of the largest
# (measured: 3% with two layers, 5.4% with three; a wrong weight or rotation is off by ~100%).
Q8_0_LOGIT_TOL = 0.1
# MoE routers (HF name suffixes, GGUF name part) stay float32 in a Q8_0 file, as llama-quantize
# leaves ffn_gate_inp: an 8-bit router would pick other experts at near-ties.
FLOAT_ROUTERS_HF = ("mlp.gate.weight", "mlp.shared_expert_gate.weight")
FLOAT_ROUTERS_GGUF = ".ffn_gate_inp"
# Engine options that split every prompt into chunks and let later prompts hit the prefix cache.
CHUNKED = dict(max_num_batched_tokens=16, block_size=16, enable_prefix_caching=True)


def byte_tokenizer(vocab_size: int = VOCAB) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer of exactly vocab_size ids: the 256 bytes, letter-pair merges,
    and the end-of-text token last (any id the model samples decodes)."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    letters = "etaoinshrdlcumwfgypbvkjxqz"
    merges = []
    for a in letters:
        for b in letters:
            if len(vocab) == vocab_size - 1:
                break
            vocab[a + b] = len(vocab)
            merges.append((a, b))
    vocab[EOS] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)


def random_init(model: torch.nn.Module, seed: int, scale: float = 0.1) -> None:
    """Weights drawn N(0, scale^2) and norm weights near 1, so that logits are spread out
    (transformers' 0.02 init makes near-ties of the greedy choice common)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(scale * torch.randn(p.shape, generator=gen))


def save_hf_dir(model: torch.nn.Module, out: Path) -> Path:
    """The model and the byte tokenizer as an HF checkpoint directory."""
    model.save_pretrained(str(out))
    byte_tokenizer(model.config.vocab_size).save_pretrained(str(out))
    return out


def q8_0_round_trip(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of model whose matrices hold the values Q8_0 blocks of them decode to, so that
    transformers can be the reference of a Q8_0 GGUF (writing them again in Q8_0 is exact)."""
    out = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in out.named_parameters():
            if p.dim() >= 2 and not name.endswith(FLOAT_ROUTERS_HF):  # matrices, stacked experts
                blocks = gguf.quants.quantize(p.numpy(), Q8_0)
                p.copy_(torch.from_numpy(gguf.quants.dequantize(blocks, Q8_0).reshape(p.shape)))
    return out


def _permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's Q/K row order for the llama architecture (convert_hf_to_gguf's permute)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def gguf_tensors(model: torch.nn.Module, arch: gguf.MODEL_ARCH,
                 permute_heads: Optional[tuple[int, int]] = None) -> dict[str, np.ndarray]:
    """GGUF name -> float32 array of each HF tensor, named by llama.cpp's converter map;
    permute_heads=(heads, kv_heads) reorders Q/K rows as the converter does for llama."""
    cfg = model.config
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    out = {}
    for hf_name, arr in _unfused_experts(model.state_dict()):
        if cfg.tie_word_embeddings and hf_name == "lm_head.weight":
            continue
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))  # "blk.0.attn_q.weight"
        assert name is not None, hf_name
        name = name if name.endswith((".weight", ".bias")) else f"{name}.weight"  # stacked experts
        kind = name.split(".")[-2]
        if permute_heads and kind in ("attn_q", "attn_k"):
            arr = _permute_qk(arr, permute_heads[0] if kind == "attn_q" else permute_heads[1])
        out[name] = arr
    return out


def _unfused_experts(state: Mapping[str, torch.Tensor]) -> list[tuple[str, np.ndarray]]:
    """(HF name, float32 array) of each tensor, transformers' fused experts.gate_up_proj
    [E, 2I, H] split into the stacked gate_proj and up_proj [E, I, H] llama.cpp stores."""
    out = []
    for hf_name, t in state.items():
        arr = t.float().numpy()
        if hf_name.endswith("experts.gate_up_proj"):
            base = hf_name.removesuffix("gate_up_proj")
            gate, up = np.split(arr, 2, axis=1)
            out += [(f"{base}gate_proj", np.ascontiguousarray(gate)),
                    (f"{base}up_proj", np.ascontiguousarray(up))]
        else:
            out.append((hf_name, arr))
    return out


def write_gguf(path: Path, arch: str, fields: Callable[[gguf.GGUFWriter], None],
               tensors: Mapping[str, np.ndarray], qtype: GGMLQuantizationType) -> None:
    """A GGUF of the tensors, its matrices and stacked experts in qtype blocks (F32 or Q8_0; 1-D
    tensors and MoE routers stay float32), with metadata written by fields(writer). Q8_0
    matrices must come from q8_0_round_trip, so that the file holds exactly the reference's
    values (checked)."""
    blocks = {}
    for name, arr in tensors.items():
        if arr.ndim >= 2 and qtype != F32 and FLOAT_ROUTERS_GGUF not in name:
            blocks[name] = gguf.quants.quantize(arr, qtype)
            held = gguf.quants.dequantize(blocks[name], qtype).reshape(arr.shape)
            assert np.array_equal(held, arr), name
    write_gguf_blocks(path, arch, fields, tensors, blocks, qtype)


def write_gguf_blocks(path: Path, arch: str, fields: Callable[[gguf.GGUFWriter], None],
                      tensors: Mapping[str, np.ndarray], blocks: Mapping[str, np.ndarray],
                      qtype: GGMLQuantizationType | Mapping[str, GGMLQuantizationType]) -> None:
    """A GGUF of the tensors: those named in blocks as those raw blocks of qtype (one type for
    all, or one per name), the rest in float32, with metadata written by fields(writer)."""
    writer = gguf.GGUFWriter(str(path), arch)
    fields(writer)
    for name, arr in tensors.items():
        if name in blocks:
            raw_dtype = qtype[name] if isinstance(qtype, Mapping) else qtype
            writer.add_tensor(name, blocks[name], raw_dtype=raw_dtype)
        else:
            writer.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def gemma_init(model: torch.nn.Module) -> None:
    """random_init for a tiny Gemma, then its norm weights as w with 1 + w near 1, and the
    embedding scaled down: with normal-sized embeddings the tied head repeats the input token."""
    random_init(model, seed=0, scale=0.3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.sub_(1)
        model.model.embed_tokens.weight.mul_(0.05 / 0.3)


def base_fields(writer: gguf.GGUFWriter, cfg) -> None:
    """The `<arch>.*` keys every decoder needs, from an HF config."""
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    # Gemma 3 keys rope_parameters by layer type; the GGUF's base is the global layers'
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)
    writer.add_rope_freq_base(rope["rope_theta"])


def prompts(lengths: tuple[int, ...], seed: int, shared: int = 20) -> list[list[int]]:
    """Random token-id prompts of the given lengths; all but the last start with the same
    `shared` tokens (a prefix the cache can serve)."""
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, VOCAB - 1, (shared,), generator=gen).tolist()
    out = []
    for i, n in enumerate(lengths):
        tail = torch.randint(0, VOCAB - 1, (n,), generator=gen).tolist()
        out.append(tail if i == len(lengths) - 1 else (prefix + tail)[:n])
    return out


@dataclass(frozen=True)
class Reference:
    """What transformers computes for each prompt: last-position logits and greedy tokens."""

    prompts: list[list[int]]
    logits: list[torch.Tensor]  # [V] each
    tokens: list[list[int]]


@torch.no_grad()
def hf_reference(model: torch.nn.Module, token_prompts: list[list[int]],
                 num_tokens: int = NUM_TOKENS) -> Reference:
    """transformers' float32 logits and greedy continuation of each prompt, one at a time.
    EOS is a token like any other, as the engine's ignore_eos takes it: min_new_tokens would
    instead forbid it, and pick the runner-up wherever EOS is the best."""
    model = model.float().eval()
    logits, tokens = [], []
    eos, model.generation_config.eos_token_id = model.generation_config.eos_token_id, None
    try:
        for p in token_prompts:
            ids = torch.tensor([p])
            logits.append(model(ids).logits[0, -1].float())
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=num_tokens, pad_token_id=0)
            tokens.append(out[0, len(p):].tolist())
    finally:
        model.generation_config.eos_token_id = eos
    assert all(len(t) == num_tokens for t in tokens)
    return Reference(token_prompts, logits, tokens)


def greedy_tokens(llm: LLM, token_prompts: list[list[int]], num_tokens: int = NUM_TOKENS
                  ) -> list[list[int]]:
    """The engine's greedy continuation of every prompt, all in one batched generate."""
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in token_prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


# A MoE router whose k-th and (k+1)-th expert probabilities are this close is at a near-tie:
# the 8-bit activations of Q8_0 blocks may pick the other expert there (measured: a 0.0008
# margin flipped, moving one greedy choice 0.8 below transformers' best), a discrete jump that
# no logit tolerance describes.
ROUTING_TIE_MARGIN = 0.01


@torch.no_grad()
def routing_ties(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """[S] bool: the positions of ids at which some MoE router of transformers' model is at a
    near-tie for its last chosen expert (all False for a dense model)."""
    ties = torch.zeros(len(ids), dtype=torch.bool)

    def hook(module, args, out):
        probs = torch.softmax(out[0].float(), dim=-1)  # router logits [S, E]
        top = probs.topk(module.top_k + 1, dim=-1).values
        ties.logical_or_(top[:, -2] - top[:, -1] < ROUTING_TIE_MARGIN)

    routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    handles = [m.register_forward_hook(hook) for m in routers]
    try:
        model(torch.tensor([ids]))
    finally:
        for h in handles:
            h.remove()
    return ties


@torch.no_grad()
def near_argmax_gap(model: torch.nn.Module, token_prompts: list[list[int]],
                    tokens: list[list[int]]) -> float:
    """How far below transformers' best logit the engine's greedy choices fall, at worst, with
    transformers reading the engine's own continuation (0: every choice was its argmax);
    choices made where a MoE router is at a near-tie are left out."""
    gap = 0.0
    for p, t in zip(token_prompts, tokens):
        logits = model(torch.tensor([p + t])).logits[0, len(p) - 1:-1]  # [N, V]
        chosen = logits.gather(1, torch.tensor(t).unsqueeze(1)).squeeze(1)
        gaps = (logits.max(dim=1).values - chosen).masked_fill(
            routing_ties(model, p + t)[len(p) - 1:-1], 0.0)
        gap = max(gap, gaps.max().item())
    return gap


def max_logit_error(llm: LLM, ref: Reference) -> float:
    """Largest |engine - transformers| over the last-position logits of every prompt."""
    return max((last_logits(llm, p) - r).abs().max().item()
               for p, r in zip(ref.prompts, ref.logits))


def prefix_hits(llm: LLM) -> int:
    """Prompt tokens the engine found in its prefix cache so far."""
    return llm.llm_engine.engine_core.kv_manager.prefix_hits


@dataclass(frozen=True)
class TinyCheckpoints:
    """One tiny model saved three ways, with the values its Q8_0 file holds and its prompts."""

    hf_dir: Path
    f32_gguf: Path
    q8_0_gguf: Path
    model: torch.nn.Module  # float32, as saved
    q8_0_model: torch.nn.Module  # the same with the matrices' Q8_0 values
    prompts: list[list[int]]


def save_checkpoints(model: torch.nn.Module, root: Path, arch: str,
                     fields: Callable[[gguf.GGUFWriter], None],
                     token_prompts: list[list[int]],
                     permute_heads: Optional[tuple[int, int]] = None,
                     extra: Optional[Mapping[str, np.ndarray]] = None) -> TinyCheckpoints:
    """The HF directory and the float32 and Q8_0 GGUFs (GGUF architecture `arch`, extra
    tensors such as rope factors added as they are) of a tiny model."""
    model_arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    hf_dir = save_hf_dir(model, root / "hf")
    q8 = q8_0_round_trip(model)
    for path, source, qtype in ((root / "f32.gguf", model, F32), (root / "q8_0.gguf", q8, Q8_0)):
        tensors = {**gguf_tensors(source, model_arch, permute_heads), **(extra or {})}
        write_gguf(path, arch, fields, tensors, qtype)
    return TinyCheckpoints(hf_dir, root / "f32.gguf", root / "q8_0.gguf", model, q8,
                           token_prompts)


def check_float32(llm: LLM, ref: Reference) -> None:
    """The same greedy tokens as transformers, batched, twice (the second time with the
    prompts' full blocks from the prefix cache), and last-position logits within 1e-4."""
    assert greedy_tokens(llm, ref.prompts) == ref.tokens
    hits = prefix_hits(llm)
    assert greedy_tokens(llm, ref.prompts) == ref.tokens
    assert prefix_hits(llm) > hits
    assert max_logit_error(llm, ref) <= 1e-4


def check_q8_0(llm: LLM, ckpts: TinyCheckpoints) -> None:
    """Logits within Q8_0_LOGIT_TOL of the largest, against transformers on the values the
    blocks hold, and greedy choices transformers rates as close to its own best (it reads the
    engine's continuation: after a near-tie the two may part, and both be right)."""
    ref = hf_reference(ckpts.q8_0_model, ckpts.prompts)
    tol = Q8_0_LOGIT_TOL * max(r.abs().max().item() for r in ref.logits)
    error = max_logit_error(llm, ref)
    assert error <= tol, (error, tol)
    tokens = greedy_tokens(llm, ckpts.prompts)
    assert near_argmax_gap(ckpts.q8_0_model, ckpts.prompts, tokens) <= tol


def _stack_equals_loop(llm: LLM, run: Callable[[], object]) -> None:
    """run() through the captured C++ decode step (counted: it must run), then through the
    model's layer loop: the same result."""
    runner = model_runner(llm)
    captured = runner.captured_decode
    calls = []

    def counting(*args):
        calls.append(1)
        return captured(*args)

    runner.captured_decode = counting
    try:
        through_stack = run()
        runner.captured_decode = None
        assert run() == through_stack
    finally:
        runner.captured_decode = captured
    assert calls


def check_captured_equals_loop(llm: LLM, token_prompts: list[list[int]]) -> None:
    """Greedy tokens through the captured C++ decode step (counted: it must run) equal those
    through the model's layer loop."""
    _stack_equals_loop(llm, lambda: greedy_tokens(llm, token_prompts))


def check_captured_equals_loop_exactly(llm: LLM, token_prompts: list[list[int]]) -> None:
    """Greedy tokens and their log-probabilities, bit for bit, through the captured C++ decode
    step (counted: it must run) and through the model's layer loop: all prompts in one batch,
    then the first alone (decode steps of one row). A first run fills the prefix cache, so that
    both compared runs compute the same prompt chunks (a cached prefix changes a chunk's rows,
    and with them the prompt's attention sums in their last bits)."""
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, logprobs=1, ignore_eos=True)

    def generate(prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [(list(o.outputs[0].token_ids),
                 [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)])
                for o in outs]

    generate(token_prompts)
    for prompts in (token_prompts, token_prompts[:1]):
        _stack_equals_loop(llm, lambda: generate(prompts))


def check_moe_op(block: torch.nn.Module) -> None:
    """A SparseMoeBlock with x8 experts: moe_forward (the op the layer loop and the C++ stack
    call) computes what route() + routed() (+ the shared expert) compute in torch on the same
    matrices, and each row's output is the same bits alone as inside a batch."""
    assert block.x8_args() is not None
    x = torch.randn(6, block.gate.in_features, generator=torch.Generator().manual_seed(4))
    batched = block(x)
    for i in range(len(x)):
        assert torch.equal(block(x[i:i + 1])[0], batched[i]), i
    expected = block.routed(x, route(block.gate(x), block.top_k, block.norm_topk_prob))
    if block.shared_expert is not None:
        expected = expected + torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
    torch.testing.assert_close(batched, expected, rtol=1e-5, atol=1e-5)
