"""Thinking models' reasoning at the token level: which parser names which tags, where a
request starts (thinking or answering, read from its prompt), and the grammar gate that lets
the thinking through unconstrained and starts a request's grammar after its end tag, as vLLM's
structured-output manager does with `reasoning_ended` per request.

    prompt ... <|im_start|>assistant\\n          qwen3: OPENING (the output may open <think>)
    prompt ... <|im_start|>assistant\\n<think>\\n  THINKING (the template opened it)
    prompt ... <think>\\n\\n</think>\\n\\n            ANSWER (enable_thinking=false closed it)

    OPENING --<think>--> THINKING --</think>--> ANSWER (the grammar starts here)
    OPENING --any other token--> ANSWER (that token is the grammar's first)
"""
from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence

if TYPE_CHECKING:  # the command line imports this module (arg_utils): it stays free of torch
    import torch

logger = logging.getLogger("pagedllm")

#: the parsers (vLLM's names) -> (start tag, end tag, whether the output itself may open the
#: thinking: Qwen3 thinks only if its output starts with <think>; a DeepSeek-R1 output is
#: thinking from its first token up to </think>)
PARSERS: dict[str, tuple[str, str, bool]] = {
    "qwen3": ("<think>", "</think>", True),
    "deepseek_r1": ("<think>", "</think>", False),
}


class Phase(enum.Enum):
    """Where a sequence is: before a possible start tag, inside the thinking, or answering."""

    OPENING = "opening"
    THINKING = "thinking"
    ANSWER = "answer"


OFF = "none"  # reasoning_parser="none": no parser, not even the chat template's


def check_parser_name(name: Optional[str], field: str = "reasoning_parser") -> None:
    """ValueError naming field for a name that is not a known parser (or "none")."""
    if name is not None and name not in PARSERS and name != OFF:
        raise ValueError(f"{field} must be one of {', '.join(PARSERS)} or {OFF!r}, got "
                         f"{name!r}")


def pick_reasoning(tokenizer: Any, name: Optional[str],
                   template: Any = None) -> Optional["ReasoningTokens"]:
    """The reasoning tags a request path uses: name's (ValueError naming reasoning_parser if
    the tokenizer lacks them), else the ones template (default: the tokenizer's chat template)
    implies, logged; None for "none" or a template that shows no thinking."""
    if name == OFF:
        return None
    if name is not None:
        return ReasoningTokens.from_tokenizer(name, tokenizer)
    picked = parser_for_template(template if template is not None
                                 else getattr(tokenizer, "chat_template", None))
    if picked is None:
        return None
    try:
        tokens = ReasoningTokens.from_tokenizer(picked, tokenizer)
    except ValueError as err:
        logger.warning("reasoning: the chat template writes <think> tags, but %s; no parser", err)
        return None
    logger.info("reasoning: using the %r parser (the chat template's <think> tags); "
                "--reasoning-parser overrides it (none: off)", picked)
    return tokens


def parser_for_template(template: Any) -> Optional[str]:
    """The parser a chat template's thinking format implies, or None: a template that writes
    <think> ... </think> and reads enable_thinking is Qwen3's kind; one that opens <think> in
    the generation prompt without that switch is DeepSeek-R1's."""
    if isinstance(template, dict):  # named templates: the default one decides
        template = template.get("default")
    if not isinstance(template, str) or "</think>" not in template:
        return None
    return "qwen3" if "enable_thinking" in template else "deepseek_r1"


@dataclass(frozen=True)
class ReasoningTokens:
    """A parser's tags as the tokenizer's ids (each tag must be one token, as in Qwen3's and
    DeepSeek-R1's vocabularies), and the ids of whitespace-only tokens (between a prompt's
    tag and its end)."""

    name: str
    start: str
    end: str
    start_id: int
    end_id: int
    output_opens: bool

    @classmethod
    def from_tokenizer(cls, name: str, tokenizer: Any) -> "ReasoningTokens":
        """The parser name's tags in tokenizer; ValueError naming reasoning_parser if a tag is
        not one token of its vocabulary."""
        check_parser_name(name)
        start, end, opens = PARSERS[name]
        ids = []
        for tag in (start, end):
            encoded = tokenizer.encode(tag, add_special_tokens=False)
            if len(encoded) != 1:
                raise ValueError(f"reasoning_parser {name!r} needs {tag} as one token of the "
                                 f"tokenizer; this one spells it with {len(encoded)} tokens")
            ids.append(encoded[0])
        return cls(name, start, end, ids[0], ids[1], opens)

    def first_phase(self, prompt_ids: Sequence[int], tokenizer: Any) -> Phase:
        """Where a request whose prompt is prompt_ids starts: the last tag of the prompt's
        tail (after whitespace-only tokens) decides, else the parser's rule."""
        for token in reversed(prompt_ids[-16:]):
            if token == self.end_id:
                return Phase.ANSWER
            if token == self.start_id:
                return Phase.THINKING
            if tokenizer.decode([token]).strip():
                break
        return Phase.OPENING if self.output_opens else Phase.THINKING


class PhaseTracker:
    """One sequence's phase, advanced token by token."""

    def __init__(self, tokens: ReasoningTokens, phase: Phase) -> None:
        self.tokens, self.phase = tokens, phase

    def advance(self, token: int) -> bool:
        """Move past token; True if it belongs to the thinking (its tags included)."""
        if self.phase is Phase.ANSWER:
            return False
        if self.phase is Phase.OPENING:
            if token != self.tokens.start_id:
                self.phase = Phase.ANSWER
                return False
            self.phase = Phase.THINKING
            return True
        if token == self.tokens.end_id:
            self.phase = Phase.ANSWER
        return True

    def count(self, token_ids: Sequence[int]) -> int:
        """How many of token_ids (the next ones) belong to the thinking."""
        return sum(self.advance(t) for t in token_ids)


class ReasoningGate:
    """A GrammarState that constrains only the answer: every id is allowed while the sequence
    thinks (in OPENING, the start tag besides the grammar's own first ids); the inner state
    sees the tokens from the first one after the thinking on."""

    def __init__(self, inner: Any, tracker: PhaseTracker) -> None:
        self.inner, self.tracker = inner, tracker

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """The ids allowed next in bitmask[row] (int32 words, 1 = allowed)."""
        phase = self.tracker.phase
        if phase is Phase.THINKING:
            bitmask[row] = -1
            return
        self.inner.fill_bitmask(bitmask, row)
        if phase is Phase.OPENING:
            start = self.tracker.tokens.start_id
            word = bitmask[row, start // 32].item()
            bit = 1 << (start % 32)
            # int32 words: set the bit and wrap back into the signed range
            bitmask[row, start // 32] = ((word | bit) + (1 << 31)) % (1 << 32) - (1 << 31)

    def check_drafts(self, drafts: list[int], bitmask: Optional[torch.Tensor] = None,
                     row: int = 0) -> int:
        """GrammarState.check_drafts through the gate. Answering: the answer's grammar checks
        them. Thinking: every id is allowed, so the drafts are kept up to the end tag (not
        included: the answer's grammar would start after it, and its masks are not computed
        for a draft), each row after them allowing every id. Before a possible start tag
        (OPENING, the output's first token): none."""
        phase = self.tracker.phase
        if phase is Phase.ANSWER:
            return self.inner.check_drafts(drafts, bitmask, row)
        if phase is Phase.OPENING:
            return 0
        end = self.tracker.tokens.end_id
        kept = drafts.index(end) if end in drafts else len(drafts)
        if bitmask is not None:
            bitmask[row + 1:row + 1 + kept] = -1
        return kept

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False if the answer's grammar rejects it."""
        if self.tracker.advance(token_id):
            return True
        return self.inner.accept(token_id)

    @property
    def is_terminated(self) -> bool:
        """The answer's grammar is complete."""
        return self.tracker.phase is Phase.ANSWER and self.inner.is_terminated

    @property
    def error(self) -> Optional[str]:
        """Why the answer's grammar stopped accepting, if it did."""
        return self.inner.error
