"""A checkpoint's weight bytes as the engine will hold them, grouped by where a pipeline stage
holds them, from its tensor table only (GGUF header, safetensors headers; else the config's
shapes): what the memory planner splits over ranks and maps from a file."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from gguf import GGML_QUANT_SIZES

from pagedllm.loader.checkpoint import Checkpoint
from pagedllm.loader.gguf.header import GGUFTensorInfo, gguf_header
from pagedllm.loader.metadata import gguf_kept_embedding
from pagedllm.loader.hf.safetensors_header import safetensors_shapes


def gguf_weight_bytes(ckpt: Checkpoint, kept_types: frozenset, itemsize: int,
                      kept_names: Optional[frozenset] = None) -> int:
    """Resident weight bytes of a GGUF whose matrices of kept_types (2-D, or 3-D stacked
    experts, which load as one block matrix per expert; of those named in kept_names, when
    given) stay in block format and whose other tensors are held at itemsize bytes per value."""
    tensors = gguf_header(ckpt.path)[1]
    return sum(t.nbytes if len(t.shape) in (2, 3) and t.qtype in kept_types
               and (kept_names is None or t.name in kept_names)
               else math.prod(t.shape) * itemsize for t in tensors)


@dataclass(frozen=True)
class WeightLayout:
    """A checkpoint's weight bytes grouped by where a pipeline stage holds them: each decoder
    layer, the token embedding (first stage), the final norm and output head (last stage), and
    anything else (first stage). `mapped_*`: of those bytes, the ones in kept GGUF blocks, which
    mmap_weights maps from a file instead of holding in anonymous memory."""

    layers: tuple[int, ...]
    embedding: int
    head: int
    other: int = 0
    mapped_layers: tuple[int, ...] = ()
    mapped_embedding: int = 0
    mapped_head: int = 0
    tied: bool = False  # the head shares the embedding: a last stage without it holds a copy
    mlp: int = 0  # of the layers' bytes, the dense MLPs' (gate, up, down)
    # a tensor-parallel split of the MLPs' intermediate rows falls on multiples of this: the
    # least common multiple of the kept down_proj blocks' sizes (models/tensor_parallel.py)
    mlp_block: int = 1

    @property
    def total(self) -> int:
        """Bytes of the whole model in one process."""
        return sum(self.layers) + self.embedding + self.head + self.other

    @property
    def mapped_total(self) -> int:
        """Bytes of the whole model's kept blocks."""
        return sum(self.mapped_layers) + self.mapped_embedding + self.mapped_head

    def tp_rank_bytes(self, world_size: int, intermediate_size: int) -> int:
        """Bytes of the largest of world_size tensor-parallel ranks: a 1/world_size share of
        everything but the MLPs, whose intermediate rows split at multiples of mlp_block, the
        first ranks a block more when the blocks do not divide (19 of 256 over 2: 10 and 9)."""
        blocks = intermediate_size // self.mlp_block
        if not self.mlp or blocks < world_size:  # refused by the split: world_size's share
            return self.total // world_size
        largest = -(-blocks // world_size) * self.mlp_block
        return (self.total - self.mlp) // world_size + self.mlp * largest // intermediate_size

    def stage_bytes(self, start: int, end: int, first: bool, last: bool) -> tuple[int, int]:
        """(bytes, of which mapped bytes) of a stage holding layers [start, end)."""
        mapped = self.mapped_layers or (0,) * len(self.layers)
        size, blocks = sum(self.layers[start:end]), sum(mapped[start:end])
        if first:
            size, blocks = size + self.embedding + self.other, blocks + self.mapped_embedding
        if last:
            size, blocks = size + self.head, blocks + self.mapped_head
            if self.tied and not first:  # keep_stage gives the tied head its own copy
                size, blocks = size + self.embedding, blocks + self.mapped_embedding
        return size, blocks


def _group(name: str) -> tuple[str, int]:
    """Where a tensor of a GGUF or an HF checkpoint sits: ("layer", i), ("embedding", 0),
    ("head", 0) or ("other", 0)."""
    for prefix in ("blk.", "model.layers."):
        if name.startswith(prefix):
            index = name[len(prefix):].split(".", 1)[0]
            if index.isdigit():
                return "layer", int(index)
    if name.startswith(("token_embd.", "model.embed_tokens.")):
        return "embedding", 0
    if name.startswith(("output.", "output_norm.", "lm_head.", "model.norm.")):
        return "head", 0
    return "other", 0


_MLP_NAMES = (".ffn_gate.", ".ffn_up.", ".ffn_down.", ".mlp.gate_proj.", ".mlp.up_proj.",
              ".mlp.down_proj.")  # a dense MLP's matrices (not experts': ffn_gate_exps, ...)


def _kept_down_block(tensors, kept_types: frozenset) -> int:
    """The least common multiple of the block sizes of a GGUF's kept down_proj matrices."""
    kept = {t.qtype for t in tensors if ".ffn_down." in t.name and t.qtype in kept_types}
    return math.lcm(*(GGML_QUANT_SIZES[q][0] for q in kept)) if kept else 1


def _layout(num_layers: int, sizes: list[tuple[str, int, int]], tied: bool,
            mlp_block: int = 1) -> WeightLayout:
    """A WeightLayout from (tensor name, bytes, mapped bytes) triples."""
    mlp = sum(size for name, size, _ in sizes if any(n in name for n in _MLP_NAMES))
    layers, mapped = [0] * num_layers, [0] * num_layers
    groups = {"embedding": [0, 0], "head": [0, 0], "other": [0, 0]}
    for name, size, blocks in sizes:
        kind, index = _group(name)
        if kind == "layer" and index < num_layers:
            layers[index] += size
            mapped[index] += blocks
        else:
            groups[kind if kind != "layer" else "other"][0] += size
            groups[kind if kind != "layer" else "other"][1] += blocks
    return WeightLayout(tuple(layers), groups["embedding"][0], groups["head"][0],
                        groups["other"][0], tuple(mapped), groups["embedding"][1],
                        groups["head"][1], tied, mlp, mlp_block)


# bytes a value of a float checkpoint's matrices in the blocks quantization="int8"/"int4" makes
# at load (layers/quantization.py): (the layers' matrices, the embedding and head). Q8_0: 32
# int8 and an fp16 scale; Q4_1: 32 nibbles, an fp16 scale and minimum; bf16: 2 bytes a value,
# regrouped eight rows at a time with no padding (csrc/x8_bf16.cpp).
AT_LOAD_BYTES: dict[str, tuple[float, float]] = {"int8": (34 / 32, 34 / 32),
                                                 "int8_g128": (34 / 32, 34 / 32),  # Q8_0's bytes
                                                 "int4": (20 / 32, 34 / 32),
                                                 "bf16": (2.0, 2.0)}


def quantized_at_load(ckpt: Checkpoint, quantization: str) -> bool:
    """Whether the model's matrices are quantized as the loader reads them: a float (HF)
    checkpoint with int8/int4/bf16 (a GGUF with those is refused before)."""
    return ckpt.kind != "gguf" and quantization in AT_LOAD_BYTES


def _at_load_bytes(name: str, shape: tuple[int, ...], itemsize: int,
                   rates: Optional[tuple[float, float]]) -> int:
    """Bytes of an HF tensor as the model holds it: a linear layer's or the embedding's matrix
    quantized at load (rates), anything else (norms, biases, MoE experts) at itemsize."""
    values = math.prod(shape)
    if rates is None or len(shape) != 2 or ".experts." in name:
        return values * itemsize
    big = name.startswith(("model.embed_tokens.", "lm_head."))
    return math.ceil(values * rates[1 if big else 0])


def weight_layout(ckpt: Checkpoint, itemsize: int, kept_types: frozenset = frozenset(),
                  kept_names: Optional[frozenset] = None, at_load: Optional[str] = None,
                  tensors: Optional[Sequence[GGUFTensorInfo]] = None) -> WeightLayout:
    """The checkpoint's weights grouped by stage, from its tensor table (GGUF header or
    safetensors headers; else the config's shapes, layers of equal size): float tensors at
    itemsize bytes a value, a GGUF's matrices of kept_types (of kept_names, when given) in
    their blocks, as gguf_weight_bytes counts them; an HF checkpoint's matrices in the blocks
    at_load ("int8"/"int4") makes of them. tensors: a GGUF's table as the plan read it
    (loader.metadata.gguf_tensors), else read here."""
    a = ckpt.arch
    tied = a.tie_word_embeddings
    if ckpt.kind == "gguf":
        sizes = []
        tensors = gguf_header(ckpt.path)[1] if tensors is None else tensors
        for t in tensors:
            kept = (len(t.shape) in (2, 3) and t.qtype in kept_types
                    and (kept_names is None or t.name in kept_names))
            size = t.nbytes if kept else math.prod(t.shape) * itemsize
            sizes.append((t.name, size, size if kept else 0))
        tied = tied or not any(name == "output.weight" for name, _, _ in sizes)
        block = _kept_down_block([t for t in tensors if kept_names is None or t.name in kept_names],
                                 kept_types)
        return _layout(a.num_hidden_layers, sizes, tied, block)
    files = sorted(ckpt.path.glob("*.safetensors"))
    if files:
        rates = AT_LOAD_BYTES.get(at_load or "")
        sizes = [(name, _at_load_bytes(name, tuple(shape), itemsize, rates), 0)
                 for f in files for name, shape in safetensors_shapes(f).items()]
        tied = tied or not any(name.startswith("lm_head.") for name, _, _ in sizes)
        return _layout(a.num_hidden_layers, sizes, tied)
    total = a.num_params()  # the config's shapes: embedding, head, equal layers
    embed = a.vocab_size * a.hidden_size
    head = a.hidden_size + (0 if tied else embed)
    per_layer = (total - embed - head) // max(1, a.num_hidden_layers)
    return WeightLayout((per_layer * itemsize,) * a.num_hidden_layers, embed * itemsize,
                        head * itemsize, tied=tied)


def planned_weight_layout(ckpt: Checkpoint, block_types: frozenset, quantization: str,
                          itemsize: int,
                          tensors: Optional[Sequence[GGUFTensorInfo]] = None) -> WeightLayout:
    """The layout of the weights as model_loader holds them: a GGUF run with its blocks kept
    ("gguf") keeps every matrix of block_types; run dequantized ("none"), only the token
    embedding's blocks (gguf_kept_embedding); an HF checkpoint with int8/int4, its matrices
    in the blocks made at load; anything else at itemsize bytes a value. tensors: a GGUF's
    table as the plan read it, else read here."""
    if ckpt.kind == "gguf" and quantization == "gguf":
        return weight_layout(ckpt, itemsize, block_types, tensors=tensors)
    if ckpt.kind == "gguf" and quantization == "none":
        embed = gguf_kept_embedding(ckpt, block_types, tensors)
        if embed is not None:
            return weight_layout(ckpt, itemsize, frozenset({embed}),
                                 frozenset({"token_embd.weight"}), tensors=tensors)
    if quantized_at_load(ckpt, quantization):
        return weight_layout(ckpt, itemsize, at_load=quantization)
    return weight_layout(ckpt, itemsize, tensors=tensors)
