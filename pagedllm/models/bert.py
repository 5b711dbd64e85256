"""BERT-family encoders (BERT, all-MiniLM, bge, e5; XLM-RoBERTa: bge-m3, bge-reranker-v2-m3):
learned absolute positions and token types, bidirectional attention, post-LayerNorm blocks, a
plain GELU MLP. XLM-RoBERTa is this encoder with its config's departures (positions from
padding_idx + 1, no token types) and its own classification head.

Parameter names follow Hugging Face's BertModel, except q/k/v, one merged module loading the
checkpoint's query/key/value by shard. A sequence is embedded with token type 0 (one sentence
per input, as sentence-transformers embeds) unless the step gives token types (a cross-encoder's
pair: 0 for the query, 1 for the document). The output is the last layer's hidden states;
pooling them into one vector is the pooler's job (layers/pooler.py), which for
BertForSequenceClassification (and XLMRobertaForSequenceClassification) runs its head
(`classify`) on the [CLS] (<s>) row.
"""
from __future__ import annotations

from typing import ClassVar, Optional

import torch
from torch import nn
from torch.nn import functional as F

from pagedllm.attention.metadata import get_forward_metadata
from pagedllm.config import EncoderConfig, ModelArchConfig
from pagedllm.layers.encoder_attention import EncoderBatch, encoder_attention, encoder_spans
from pagedllm.layers.linear import MergedLinear
from pagedllm.models.checkpoint_names import checkpoint_params

_ACTIVATIONS = {"gelu": F.gelu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
                "relu": F.relu}


def _embedding(rows: int, width: int) -> nn.Embedding:
    """An nn.Embedding with an explicit (uninitialised) weight: its normal_() init on the meta
    device imports torch._dynamo (~1.5 s)."""
    return nn.Embedding(rows, width, _weight=torch.empty(rows, width))


class BertEmbeddings(nn.Module):
    """word + position + token-type embeddings, then LayerNorm."""

    def __init__(self, cfg: ModelArchConfig, enc: EncoderConfig) -> None:
        super().__init__()
        self.word_embeddings = _embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = _embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = _embedding(enc.type_vocab_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=enc.layer_norm_eps)
        self.position_offset = enc.position_offset

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """[T] ids at [T] positions (of [T] token types; None: all 0) -> [T, H]; position p
        reads learned row p + position_offset (XLM-RoBERTa's padding_idx + 1)."""
        offset = self.position_offset
        x = self.word_embeddings(input_ids) + self.position_embeddings(
            positions + offset if offset else positions)
        types = (self.token_type_embeddings.weight[0] if token_type_ids is None
                 else self.token_type_embeddings(token_type_ids))
        return self.LayerNorm(x + types)


class BertSelfAttention(nn.Module):
    """Merged query/key/value projection with biases (HF's attention.self)."""

    def __init__(self, cfg: ModelArchConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        width = self.num_heads * self.head_dim
        self.qkv = MergedLinear(cfg.hidden_size, (width,) * 3, ("query", "key", "value"),
                                bias=True)

    def forward(self, x: torch.Tensor, batch: EncoderBatch) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = (y.view(t, self.num_heads, self.head_dim) for y in self.qkv(x))  # [T, H, D]
        return encoder_attention(q, k, v, batch, self.head_dim ** -0.5).reshape(t, -1)


class BertDenseNorm(nn.Module):
    """dense, then LayerNorm over it plus the residual (HF's *.output)."""

    def __init__(self, in_features: int, hidden: int, eps: float) -> None:
        super().__init__()
        self.dense = nn.Linear(in_features, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    """Self-attention and its post-LayerNorm output block."""

    def __init__(self, cfg: ModelArchConfig, enc: EncoderConfig) -> None:
        super().__init__()
        self.self = BertSelfAttention(cfg)
        self.output = BertDenseNorm(cfg.hidden_size, cfg.hidden_size, enc.layer_norm_eps)

    def forward(self, x: torch.Tensor, batch: EncoderBatch) -> torch.Tensor:
        return self.output(self.self(x, batch), x)


class BertIntermediate(nn.Module):
    """The MLP's up projection and activation."""

    def __init__(self, cfg: ModelArchConfig, enc: EncoderConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.act = _ACTIVATIONS[enc.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class BertLayer(nn.Module):
    """Attention block then MLP block, each followed by LayerNorm over it plus its input."""

    def __init__(self, cfg: ModelArchConfig, enc: EncoderConfig) -> None:
        super().__init__()
        self.attention = BertAttention(cfg, enc)
        self.intermediate = BertIntermediate(cfg, enc)
        self.output = BertDenseNorm(cfg.intermediate_size, cfg.hidden_size, enc.layer_norm_eps)

    def forward(self, x: torch.Tensor, batch: EncoderBatch) -> torch.Tensor:
        x = self.attention(x, batch)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    """The layer stack."""

    def __init__(self, cfg: ModelArchConfig, enc: EncoderConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(cfg, enc) for _ in range(cfg.num_hidden_layers))


class BertModel(nn.Module):
    """A BERT encoder over whole sequences: hidden states for every token of the step."""

    # tensors of HF's BertModel (XLMRobertaModel) the encoder does not use: the [CLS] pooler
    # head (trained for next-sentence prediction; sentence-transformers ignores it) and the
    # position-id and token-type buffers
    unused_checkpoint_prefixes = ("pooler.", "embeddings.position_ids",
                                  "embeddings.token_type_ids")

    def __init__(self, cfg: ModelArchConfig, max_positions: int) -> None:
        super().__init__()
        if cfg.encoder is None:
            raise ValueError(f"architecture {cfg.architecture!r} is not an encoder")
        if max_positions > cfg.max_positions:
            raise ValueError(f"max_model_len={max_positions} is longer than the encoder's "
                             f"{cfg.max_positions} learned positions")
        self.config = cfg
        self.embeddings = BertEmbeddings(cfg, cfg.encoder)
        self.encoder = BertEncoder(cfg, cfg.encoder)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate: Optional[object] = None,
                token_type_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Hidden states [T, H] of flattened whole sequences input_ids [T] at positions [T]
        (token types [T], None: all 0); where each sequence starts comes from the step's
        metadata."""
        if intermediate is not None:
            raise ValueError("an encoder runs as one pipeline stage")
        batch = EncoderBatch.from_spans(encoder_spans(get_forward_metadata()), input_ids.device)
        x = self.embeddings(input_ids, positions, token_type_ids)
        for layer in self.encoder.layer:
            x = layer(x, batch)
        return x

    def tie_weights(self) -> None:
        """Nothing is tied in an encoder."""

    def checkpoint_params(self) -> dict[str, torch.Tensor]:
        """Checkpoint tensor name -> the tensor it loads into (models/checkpoint_names.py)."""
        return checkpoint_params(self)

    @classmethod
    def skips_checkpoint_tensor(cls, name: str) -> bool:
        """Whether a checkpoint tensor is one the encoder leaves unread."""
        return name.startswith(cls.unused_checkpoint_prefixes)


class BertPooler(nn.Module):
    """HF's BertPooler: dense and tanh over the [CLS] row."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)

    def forward(self, cls_rows: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(cls_rows))


class _SequenceClassifier(nn.Module):
    """An encoder (BertModel, under the checkpoint's prefix `body`) with a sequence
    classification head: the hidden states come out of forward as BertModel's do; `classify`
    turns each sequence's first-token ([CLS], <s>) rows into the head's logits."""

    body: ClassVar[str]  # the encoder's checkpoint prefix ("bert", "roberta")

    def __init__(self, cfg: ModelArchConfig, max_positions: int) -> None:
        super().__init__()
        if cfg.encoder is None or cfg.classifier is None:
            raise ValueError(f"architecture {cfg.architecture!r} has no classification labels")
        self.config = cfg
        setattr(self, self.body, BertModel(cfg, max_positions))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate: Optional[object] = None,
                token_type_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Hidden states [T, H], as BertModel.forward."""
        return getattr(self, self.body)(input_ids, positions, intermediate, token_type_ids)

    def classify(self, cls_rows: torch.Tensor) -> torch.Tensor:
        """[N, H] hidden states of each sequence's first token -> [N, labels] logits."""
        raise NotImplementedError

    def tie_weights(self) -> None:
        """Nothing is tied in an encoder."""

    def checkpoint_params(self) -> dict[str, torch.Tensor]:
        """Checkpoint tensor name -> the tensor it loads into (models/checkpoint_names.py)."""
        return checkpoint_params(self)

    @classmethod
    def skips_checkpoint_tensor(cls, name: str) -> bool:
        """The position-id and token-type buffers some checkpoints save are not weights."""
        return name in (f"{cls.body}.embeddings.position_ids",
                        f"{cls.body}.embeddings.token_type_ids")


class BertForSequenceClassification(_SequenceClassifier):
    """A BERT encoder with HF's sequence-classification head (a cross-encoder such as
    bge-reranker's and ms-marco's, or a classifier): dense and tanh over [CLS] (BertPooler),
    then a linear layer."""

    body = "bert"

    def __init__(self, cfg: ModelArchConfig, max_positions: int) -> None:
        super().__init__(cfg, max_positions)
        self.bert.pooler = BertPooler(cfg.hidden_size)
        self.classifier = nn.Linear(cfg.hidden_size, cfg.classifier.num_labels)

    def classify(self, cls_rows: torch.Tensor) -> torch.Tensor:
        """[N, H] [CLS] rows -> [N, labels] logits."""
        return self.classifier(self.bert.pooler(cls_rows))


class RobertaClassificationHead(nn.Module):
    """HF's RobertaClassificationHead: dense and tanh over the <s> row, then out_proj."""

    def __init__(self, hidden: int, labels: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, labels)

    def forward(self, cls_rows: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(cls_rows)))


class XLMRobertaForSequenceClassification(_SequenceClassifier):
    """An XLM-RoBERTa encoder with HF's classification head (bge-reranker-v2-m3's shape)."""

    body = "roberta"

    def __init__(self, cfg: ModelArchConfig, max_positions: int) -> None:
        super().__init__(cfg, max_positions)
        self.classifier = RobertaClassificationHead(cfg.hidden_size, cfg.classifier.num_labels)

    def classify(self, cls_rows: torch.Tensor) -> torch.Tensor:
        """[N, H] <s> rows -> [N, labels] logits."""
        return self.classifier(cls_rows)
