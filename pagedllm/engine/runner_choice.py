"""Which runner a checkpoint gets (generate or pooling) and, for pooling, how it pools and how
long its inputs may be, from EngineArgs and the checkpoint's files."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from pagedllm.config import PoolerConfig
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.loader.checkpoint import Checkpoint
from pagedllm.loader.errors import read_json_object
from pagedllm.loader.gguf.encoder import gguf_pooler_config
from pagedllm.loader.hf.pooling_files import pooler_config

# vLLM's default for a decoder run as an embedding model: the last token, normalised
DECODER_POOLER = PoolerConfig("last", normalize=True)


@dataclass(frozen=True)
class RunnerChoice:
    """The runner, its pooler (pooling only) and the longest input its files allow."""

    runner: str  # "generate" or "pooling"
    pooler: Optional[PoolerConfig] = None
    max_seq_length: Optional[int] = None  # sentence_bert_config.json's; None: the model's


def _max_seq_length(root: Path) -> Optional[int]:
    """sentence_bert_config.json's max_seq_length (sentence-transformers truncates there; vLLM
    takes it as the longest input), or None."""
    file = root / "sentence_bert_config.json"
    if not file.is_file():
        return None
    value = read_json_object(file).get("max_seq_length")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return None
    return value


def _check_encoder_options(args: EngineArgs, arch: str) -> None:
    """Refuse, by name, the options an encoder does not run with yet."""
    for name in ("tensor_parallel_size", "pipeline_parallel_size"):
        if getattr(args, name) > 1:
            raise ValueError(f"{name}={getattr(args, name)}: a {arch} encoder runs on one rank "
                             "(its layers declare no split)")
    if args.quantization not in (None, "none"):
        raise ValueError(f"quantization={args.quantization!r} with a {arch} encoder is not "
                         "implemented; its weights run as stored (quantization='none')")


def choose_runner(args: EngineArgs, ckpt: Checkpoint) -> RunnerChoice:
    """runner "auto" picks pooling for an encoder and generate for a decoder; a runner the
    checkpoint cannot serve is refused by name, saying what serves it."""
    asked, arch = args.resolved_runner(), ckpt.arch
    if arch.is_encoder:
        if asked == "generate":
            raise ValueError(f"runner='generate': {arch.architecture} is an encoder, which "
                             "embeds and does not generate; use runner='pooling' (LLM.embed, "
                             "/v1/embeddings)")
        _check_encoder_options(args, arch.architecture)
        if ckpt.kind == "gguf":  # no sentence-transformers files: its metadata says
            return RunnerChoice("pooling", gguf_pooler_config(ckpt.path))
        root = ckpt.path
        # a classification head reads the [CLS] row, as HF's BertForSequenceClassification
        pooler = (PoolerConfig("cls", normalize=False) if arch.num_labels
                  else pooler_config(root))
        return RunnerChoice("pooling", pooler, _max_seq_length(root))
    if arch.classifier is not None:
        return _decoder_classifier(args, ckpt, asked)
    if asked == "pooling":
        return _decoder_pooling(args, ckpt)
    return RunnerChoice("generate")


def _check_one_rank(args: EngineArgs, arch: str) -> None:
    """A pooling decoder runs on one rank: tensor and pipeline parallelism are refused."""
    for name in ("tensor_parallel_size", "pipeline_parallel_size"):
        if getattr(args, name) > 1:
            raise ValueError(f"{name}={getattr(args, name)} with runner='pooling' is not "
                             f"implemented: a pooling {arch} decoder runs on one rank")


def _decoder_classifier(args: EngineArgs, ckpt: Checkpoint, asked: str) -> RunnerChoice:
    """A decoder with a classification head (Qwen3ForSequenceClassification, Qwen3-Reranker
    through hf_overrides) pools its last token into the head, as vLLM's pooling runner; its
    weights run as stored, since the head reads the LM head's rows."""
    arch = ckpt.arch.architecture
    if asked == "generate":
        raise ValueError(f"runner='generate': this {arch} checkpoint has a classification head "
                         "(its architectures name *ForSequenceClassification); it scores and "
                         "classifies (LLM.score, /rerank) and does not generate")
    _check_one_rank(args, arch)
    if args.quantization not in (None, "none"):
        raise ValueError(f"quantization={args.quantization!r} with a classifier {arch} "
                         "decoder is not implemented; its weights run as stored "
                         "(quantization='none')")
    root = ckpt.path if ckpt.path.is_dir() else ckpt.path.parent
    return RunnerChoice("pooling", PoolerConfig("last", normalize=False), _max_seq_length(root))


def _decoder_pooling(args: EngineArgs, ckpt: Checkpoint) -> RunnerChoice:
    """A decoder as an embedding model (Qwen3-Embedding's, gte-Qwen2's shape): the last
    token's final hidden state, normalised, unless its sentence-transformers files say
    otherwise; its prompt is read in chunks, so only last-token pooling is possible."""
    arch = ckpt.arch.architecture
    _check_one_rank(args, arch)
    root = ckpt.path if ckpt.path.is_dir() else ckpt.path.parent
    pooler = pooler_config(root, DECODER_POOLER)
    if pooler.pooling_type != "last":
        raise ValueError(f"{pooler.pooling_type} pooling with a {arch} decoder is not "
                         "implemented: a decoder's prompt is read in chunks, and only its last "
                         "token's state sees the whole input (last-token pooling)")
    return RunnerChoice("pooling", pooler, _max_seq_length(root))
