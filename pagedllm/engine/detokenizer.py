"""Incremental detokenization and stop-string detection for one sequence."""
from __future__ import annotations

from typing import Optional

from tokenizers.decoders import DecodeStream

from pagedllm.sampling_params import SamplingParams


class IncrementalDetokenizer:
    """Turns tokens into text as they arrive (whole UTF-8 characters only) and finds stop strings."""

    def __init__(self, tokenizer, params: SamplingParams) -> None:
        self._backend = tokenizer.backend_tokenizer  # tokenizers.Tokenizer of a fast HF tokenizer
        self._stream = DecodeStream(skip_special_tokens=params.skip_special_tokens)
        self._stops = params.stop or []
        self._include_stop = params.include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in self._stops), default=0)
        # the end of the text that may still become a stop string, and so be cut, is held back
        # from unfinished outputs: a stream never shows text it later takes back (as vLLM does)
        self._hold = self._max_stop_len - 1 if self._stops and not self._include_stop else 0
        self.text = ""
        self.num_used = 0  # tokens the last update took (update)

    def output_text(self, finished: bool) -> str:
        """The text to show: all of it once the sequence is finished, else without the last
        (longest stop string - 1) characters, which a stop string may still claim."""
        if finished or not self._hold:
            return self.text
        return self.text[:max(0, len(self.text) - self._hold)]

    def update(self, token_ids: list[int]) -> Optional[str]:
        """Append tokens' text; return the stop string if one now appears (text is cut there).
        num_used: how many of token_ids it took, up to the one that completed the stop
        string (a speculative step brings several; those after it are not output)."""
        for i, token_id in enumerate(token_ids):
            piece = self._stream.step(self._backend, token_id)
            if not piece:
                continue
            self.text += piece
            stop = self._find_stop(len(piece))
            if stop is not None:
                self.num_used = i + 1
                return stop
        self.num_used = len(token_ids)
        return None

    def _find_stop(self, new_chars: int) -> Optional[str]:
        if not self._stops:
            return None
        # a stop string can only end inside the new text, so only its neighbourhood is searched
        search_from = max(0, len(self.text) - new_chars - self._max_stop_len + 1)
        best: Optional[tuple[int, str]] = None
        for stop in self._stops:
            idx = self.text.find(stop, search_from)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return None
        idx, stop = best
        self.text = self.text[:idx + len(stop)] if self._include_stop else self.text[:idx]
        return stop
