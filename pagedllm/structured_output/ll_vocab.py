"""llguidance's view of a tokenizer's vocabulary, read from its Rust tokenizer.

llguidance.hf.from_tokenizer does the same but accepts only a transformers
PreTrainedTokenizerFast (and imports transformers, ~1 s); the engine's tokenizer is pagedllm's
FastTokenizer, which has the same `backend_tokenizer` and `eos_token_id`.
"""
from __future__ import annotations

from copy import copy
from typing import Any, Optional

import llguidance

from pagedllm.structured_output.grammar import GrammarCompiler


def ll_tokenizer(tokenizer: Any, n_vocab: Optional[int] = None) -> llguidance.LLTokenizer:
    """The LLTokenizer of any tokenizer with a Rust `backend_tokenizer` and an eos_token_id."""
    backend = copy(tokenizer.backend_tokenizer)  # padding and truncation off, on a copy
    backend.no_padding()
    backend.no_truncation()
    return llguidance.LLTokenizer(backend.to_str(), n_vocab=n_vocab,
                                  eos_token=tokenizer.eos_token_id)


class BackendGrammarCompiler(GrammarCompiler):
    """A GrammarCompiler whose llguidance vocabulary comes from ll_tokenizer (from_tokenizer
    refuses a tokenizer that is not transformers'). Stop-gap: once grammar.py calls
    ll_tokenizer itself, this class goes."""

    def _tokenizer(self) -> llguidance.LLTokenizer:
        # built on first use (~1 s for a 152k vocabulary), under the compiler's lock
        if self._ll_tokenizer is None:
            self._ll_tokenizer = ll_tokenizer(self._hf_tokenizer, n_vocab=self._vocab_size)
        return self._ll_tokenizer
