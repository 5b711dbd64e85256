"""Whether two tokenizers share one vocabulary: a draft model proposes token ids that the
target model verifies, so an id must mean the same text to both."""
from __future__ import annotations

from typing import Any


def check_same_vocabulary(target: Any, draft: Any, target_name: str, draft_name: str) -> None:
    """ValueError naming both models unless every token has the same id in both tokenizers
    (their embedding tables may still differ in padding rows past the tokens)."""
    ours, theirs = target.get_vocab(), draft.get_vocab()
    if ours == theirs:
        return
    differ = sorted(t for t in ours.keys() | theirs.keys() if ours.get(t) != theirs.get(t))
    examples = ", ".join(f"{t!r}: {ours.get(t)} vs {theirs.get(t)}" for t in differ[:3])
    raise ValueError(
        f"speculative_config.model {draft_name!r} does not share the vocabulary of the model "
        f"{target_name!r}: {len(differ)} of its {len(theirs)} tokens differ from the target's "
        f"{len(ours)} (e.g. {examples}); a draft model must use the same tokenizer")
