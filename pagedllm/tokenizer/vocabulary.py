"""Whether two tokenizers share one vocabulary: a draft model proposes token ids that the
target model verifies, so an id must mean the same text to both."""
from __future__ import annotations

from typing import Any


def check_same_vocabulary(target: Any, draft: Any, target_name: str, draft_name: str) -> None:
    """ValueError naming both models unless every id the two tokenizers both have stands for
    the same token in each. One may have ids the other lacks (Qwen2-7B's GGUF pads its token
    list to its embedding rows, 152064; Qwen2.5-0.5B's has 151936): a draft of such an id is
    verified by the target like any other."""
    ours = {i: t for t, i in target.get_vocab().items()}
    theirs = {i: t for t, i in draft.get_vocab().items()}
    differ = sorted(i for i in ours.keys() & theirs.keys() if ours[i] != theirs[i])
    if not differ:
        return
    examples = ", ".join(f"id {i}: {ours[i]!r} vs {theirs[i]!r}" for i in differ[:3])
    raise ValueError(
        f"speculative_config.model {draft_name!r} does not share the vocabulary of the model "
        f"{target_name!r}: {len(differ)} of the {len(ours.keys() & theirs.keys())} ids both "
        f"have stand for different tokens (e.g. {examples}); a draft model must use the same "
        "tokenizer")
