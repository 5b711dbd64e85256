"""The handlers' tokenizing: the character bound that refuses a prompt without tokenizing it is
sound (never refuses a prompt that fits) on SmolLM2 and absent for tokenizers that may drop
input; the tokenizing runs on its worker thread while the event loop keeps running."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from pagedllm.entrypoints.openai.prompt_tokens import CharBound, PromptTokens, char_bound
from pagedllm.tokenizer.tokenizer import load_tokenizer

MAX_MODEL_LEN = 8192


@pytest.fixture(scope="module")
def tokenizer(smollm_gguf):
    return load_tokenizer(smollm_gguf.parent)


def test_smollm2_bound_is_its_longest_vocabulary_string(tokenizer):
    longest = max(len(t) for t in tokenizer.get_vocab())
    # SmolLM2 has no token for six ASCII control bytes: those characters vanish
    assert char_bound(tokenizer) == CharBound(81, "\x04\x06\x13\x14\x16\x1d") and longest == 81
    assert tokenizer.encode("\x04" * 10) == []


def test_no_text_has_fewer_tokens_than_the_bound_says(tokenizer):
    bound = char_bound(tokenizer)
    vocab = tokenizer.get_vocab()
    longest = sorted(vocab, key=len, reverse=True)[:20]  # the texts that pack the most per token
    texts = [tokenizer.decode([vocab[t]]) * 50 for t in longest]
    texts += ["naïve café 東京 🤖🧠 " * 200, "\u0301" * 500, "\U0001F600" * 300, " " * 5000,
              "\x04\x06" * 1000 + "a", "".join(map(chr, range(1, 0x800))), "\U00040000" * 99]
    for text in texts:
        assert len(tokenizer.encode(text)) >= bound.fewest_tokens(text), text[:40]
    assert bound.fewest_tokens("\x04\x06" * 1000 + "a") == 1


def _toy(model, pre=None, normalizer=None) -> PreTrainedTokenizerFast:
    tok = Tokenizer(model)
    if pre is not None:
        tok.pre_tokenizer = pre
    if normalizer is not None:
        tok.normalizer = normalizer
    return PreTrainedTokenizerFast(tokenizer_object=tok)


# every byte has a token, both as a byte-level string and as a byte-fallback token
BYTES = [*pre_tokenizers.ByteLevel.alphabet(), *(f"<0x{b:02X}>" for b in range(256))]
VOCAB = {t: i for i, t in enumerate(["ab", "abab", "[UNK]", *BYTES])}
BPE = dict(vocab=VOCAB, merges=[("a", "b"), ("ab", "ab")])
PARTIAL = dict(vocab={t: i for i, t in enumerate(["a", "b", "ab", "abab"])},
               merges=[("a", "b"), ("ab", "ab")])


@pytest.mark.parametrize("tok,expected", [
    # Llama-2's sentencepiece layout: byte fallback, spaces as '▁'
    (_toy(models.BPE(**BPE, byte_fallback=True), pre_tokenizers.Metaspace(),
          normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])), 6),
    (_toy(models.BPE(**BPE), pre_tokenizers.ByteLevel()), 6),
    (_toy(models.BPE(**BPE), pre_tokenizers.ByteLevel(), normalizers.NFC()), 4 * 6),  # composes
    # may drop input: no bound
    (_toy(models.BPE(**BPE), pre_tokenizers.ByteLevel(), normalizers.StripAccents()), None),
    (_toy(models.BPE(**BPE), pre_tokenizers.Whitespace()), None),
    (_toy(models.BPE(**BPE, unk_token="[UNK]"), pre_tokenizers.Metaspace()), None),
    (_toy(models.BPE(**PARTIAL), pre_tokenizers.ByteLevel()), None),  # 'x' would vanish
    (_toy(models.BPE(**PARTIAL, byte_fallback=True), pre_tokenizers.Metaspace()), None),
    (_toy(models.WordPiece(VOCAB, unk_token="[UNK]"), pre_tokenizers.BertPreTokenizer()), None),
])
def test_bound_only_where_every_character_reaches_a_token(tok, expected):
    bound = char_bound(tok)
    assert (bound and bound.chars_per_token) == expected
    assert bound is None or bound.vanishing == ""


def test_check_text_refuses_exactly_the_texts_that_cannot_fit(tokenizer):
    tokens = PromptTokens(tokenizer, MAX_MODEL_LEN)
    fits = (MAX_MODEL_LEN - 1) * tokens.bound.chars_per_token  # could still be 8191 tokens
    tokens.check_text("x" * fits, "prompt")
    with pytest.raises(ValueError, match=r"^prompt\[2\] is 663472 characters long, so at least "
                       "8192 tokens, but max_model_len is 8192"):
        tokens.check_text("x" * (fits + 1), "prompt[2]")
    with pytest.raises(ValueError, match="^prompt is 8192 tokens long but max_model_len is 8192"):
        tokens.check_ids([0] * MAX_MODEL_LEN, "prompt")
    tokens.check_ids([0] * (MAX_MODEL_LEN - 1), "prompt")


def test_encode_is_the_engines_tokenizing_on_the_worker_thread(tokenizer):
    tokens = PromptTokens(tokenizer, MAX_MODEL_LEN)
    text = "hello world " * 50_000

    async def main():
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.005)
                ticks += 1

        ticker = asyncio.create_task(tick())
        t0 = time.monotonic()
        ids = await tokens.encode(["Hello world", text], ["prompt[0]", "prompt[1]"])
        took, during = time.monotonic() - t0, ticks
        ticker.cancel()
        thread = await tokens.run(lambda: threading.current_thread().name)
        return ids, took, during, thread

    (short, long), took, ticks, thread = asyncio.run(main())
    assert short == tokenizer.encode("Hello world") and len(long) == 100_001
    assert thread.startswith("pagedllm-tokenize")
    # on the event loop, no tick could land before the 100k tokens were done
    assert ticks >= 3, (ticks, took)
