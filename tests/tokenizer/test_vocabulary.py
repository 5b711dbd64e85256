"""check_same_vocabulary: a draft model's ids must mean the target's tokens."""
import pytest

from pagedllm.tokenizer.vocabulary import check_same_vocabulary


class Vocab:
    """Anything with get_vocab(), as the tokenizers have."""

    def __init__(self, tokens: list[str]) -> None:
        self.tokens = tokens

    def get_vocab(self) -> dict[str, int]:
        return {t: i for i, t in enumerate(self.tokens)}


def test_the_shipped_tokenizer_and_a_padded_copy_share_a_vocabulary(qwen_gguf):
    from pagedllm.tokenizer.tokenizer import load_tokenizer

    tok = load_tokenizer(qwen_gguf)
    check_same_vocabulary(tok, tok, "a", "b")
    # Qwen2-7B's GGUF pads its tokens to its 152064 embedding rows: the ids it adds are extra
    padded = Vocab([t for t, _ in sorted(tok.get_vocab().items(), key=lambda x: x[1])]
                   + [f"[PAD{i}]" for i in range(128)])
    check_same_vocabulary(tok, padded, "qwen2-7b", "qwen2.5-0.5b")


def test_ids_that_mean_other_tokens_are_refused_naming_both_models():
    with pytest.raises(ValueError) as err:
        check_same_vocabulary(Vocab(["a", "b", "c"]), Vocab(["a", "c", "b", "d"]), "target-m",
                              "draft-m")
    message = str(err.value)
    assert "'draft-m'" in message and "'target-m'" in message
    assert "2 of the 3 ids" in message and "id 1: 'b' vs 'c'" in message
