"""Perplexity of a loaded LLM on a fixed text, from prompt logprobs.

The text shipped with pagedllm (data/gpl-3.0-excerpt.txt: the preamble and first sections of
the GNU GPL v3, whose verbatim copying is permitted) is what the quantization bounds are
measured on: a few thousand tokens, identical on every machine.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

from pagedllm.sampling_params import SamplingParams

DEFAULT_TEXT = Path(__file__).parent / "data" / "gpl-3.0-excerpt.txt"


def perplexity(llm, text: Optional[str] = None, max_tokens: Optional[int] = None) -> float:
    """exp(mean negative log-likelihood) of the text's tokens after the first, in one prompt."""
    text = DEFAULT_TEXT.read_text() if text is None else text
    ids = llm.llm_engine.tokenizer.encode(text)  # not get_tokenizer(): no transformers import
    if max_tokens is not None:
        ids = ids[:max_tokens]
    if len(ids) < 2:
        raise ValueError("text must have at least 2 tokens")
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    nll = [-entry[tok].logprob for tok, entry in zip(ids[1:], out.prompt_logprobs[1:])]
    return math.exp(sum(nll) / len(nll))
