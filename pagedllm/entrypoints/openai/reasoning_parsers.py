"""Reasoning parsers (vLLM's --reasoning-parser qwen3 | deepseek_r1): a thinking model's output
text -> (reasoning, content), whole or streamed, before any tool-call parsing sees the content.

    <think>\\nLet me see.\\n</think>\\n\\nThe answer.  ->  reasoning "\\nLet me see.\\n",
                                                      content "The answer."

Where a request starts (thinking, answering, or before a possible <think>) is read from its
prompt by the same rule the grammar gate uses (structured_output/reasoning.py), so the text
split, the reasoning token count and the constraint agree. An output cut off inside the
thinking has reasoning and an empty content.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from pagedllm.entrypoints.openai.tool_parsers import held_prefix
from pagedllm.structured_output.reasoning import Phase, PhaseTracker, ReasoningTokens


@dataclass
class ReasoningDelta:
    """What one piece of output text yields: reasoning and answer text to send now."""

    reasoning: str = ""
    content: str = ""

    def __add__(self, other: "ReasoningDelta") -> "ReasoningDelta":
        return ReasoningDelta(self.reasoning + other.reasoning, self.content + other.content)


class ReasoningStreamer:
    """One choice's text split as it comes. A tag cut between two pieces is held until it is
    whole; the newlines right after the end tag are dropped (Qwen3 and DeepSeek-R1 write
    "</think>\\n\\n" before the answer)."""

    def __init__(self, tokens: ReasoningTokens, phase: Phase) -> None:
        self.tokens = tokens
        # OPENING: a leading start tag opens the thinking (it is dropped either way); without
        # one, a Qwen3 output is all answer and a DeepSeek-R1 one starts thinking
        self.state = Phase.ANSWER if phase is Phase.ANSWER else Phase.OPENING
        self.unopened = Phase.ANSWER if phase is Phase.OPENING else Phase.THINKING
        self.thought = phase is Phase.THINKING  # any reasoning (even empty) to report
        self.buffer = ""
        self.after_end = False  # newlines at the answer's start are dropped

    def feed(self, text: str) -> ReasoningDelta:
        """Take the next piece of generated text."""
        self.buffer += text
        out = ReasoningDelta()
        while self.buffer:
            if self.state is Phase.OPENING:
                if not self._open():
                    return out
            elif self.state is Phase.THINKING:
                end = self.buffer.find(self.tokens.end)
                if end < 0:
                    keep = held_prefix(self.buffer, self.tokens.end)
                    out.reasoning += self.buffer[:len(self.buffer) - keep]
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    return out
                out.reasoning += self.buffer[:end]
                self.buffer = self.buffer[end + len(self.tokens.end):]
                self.state, self.after_end = Phase.ANSWER, True
            else:
                if self.after_end:
                    self.buffer = self.buffer.lstrip("\n")
                    if not self.buffer:
                        return out
                    self.after_end = False
                out.content += self.buffer
                self.buffer = ""
        return out

    def _open(self) -> bool:
        """Decide OPENING once the text shows whether it starts with the start tag; False
        while it cannot tell yet (only whitespace, or a prefix of the tag)."""
        head = self.buffer.lstrip()
        start = self.tokens.start
        if not head or (len(head) < len(start) and start.startswith(head)):
            return False
        if head.startswith(start):
            self.buffer, self.state = head[len(start):], Phase.THINKING
        else:
            self.state = self.unopened
        self.thought = self.thought or self.state is Phase.THINKING
        return True

    def finish(self) -> ReasoningDelta:
        """The end of the output: held text goes where the state says."""
        text, self.buffer = self.buffer, ""
        if self.state is Phase.OPENING:
            self.state = self.unopened
            self.thought = self.thought or self.state is Phase.THINKING
        if self.state is Phase.THINKING:
            return ReasoningDelta(reasoning=text)
        return ReasoningDelta(content="" if self.after_end else text)


class ReasoningParser:
    """A request's reasoning split: the tags and the phase its prompt leaves it in."""

    def __init__(self, tokens: ReasoningTokens, tokenizer: Any,
                 prompt_token_ids: Sequence[int]) -> None:
        self.tokens = tokens
        self.phase = tokens.first_phase(prompt_token_ids, tokenizer)

    def streamer(self) -> ReasoningStreamer:
        """A fresh text splitter for one choice."""
        return ReasoningStreamer(self.tokens, self.phase)

    def tracker(self) -> PhaseTracker:
        """A fresh token counter for one choice."""
        return PhaseTracker(self.tokens, self.phase)

    def split(self, text: str) -> tuple[Optional[str], str]:
        """(reasoning, or None when the output did not think; the answer) of a whole output."""
        stream = self.streamer()
        out = stream.feed(text) + stream.finish()
        return (out.reasoning if stream.thought else None), out.content

    def count(self, token_ids: Sequence[int]) -> int:
        """How many of a whole output's tokens are reasoning (the tags included)."""
        return self.tracker().count(token_ids)


def reasoning_fields(reasoning: Optional[str]) -> dict[str, str]:
    """A message's or delta's reasoning under vLLM's current name and its older alias."""
    if reasoning is None:
        return {}
    return {"reasoning": reasoning, "reasoning_content": reasoning}
