"""Engine fixtures: the real tokenizers of the shipped models, each loaded once per session."""
from __future__ import annotations

from pathlib import Path

import pytest

from pagedllm.loader.checkpoint import resolve_checkpoint
from pagedllm.tokenizer.tokenizer import load_tokenizer


def _engine_tokenizer(gguf: Path):
    """The tokenizer LLMEngine.from_engine_args loads for this GGUF (Checkpoint.tokenizer_path)."""
    return load_tokenizer(resolve_checkpoint(gguf).tokenizer_path)


@pytest.fixture(scope="session")
def qwen_tokenizer(qwen_gguf: Path):
    """Qwen2.5 byte-level BPE (152k tokens; most CJK and emoji are whole tokens)."""
    return _engine_tokenizer(qwen_gguf)


@pytest.fixture(scope="session")
def smollm_tokenizer(smollm_gguf: Path):
    """SmolLM2 byte-level BPE (49k tokens; emoji and CJK split into byte tokens)."""
    return _engine_tokenizer(smollm_gguf)
