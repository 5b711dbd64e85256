"""Prompt (text, token ids or a dict of either) + SamplingParams -> engine-core Requests."""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, Iterable, Optional, Union

from pagedllm.config import ModelArchConfig, StructuredOutputsConfig
from pagedllm.core.request import Request
from pagedllm.lora.request import LoRARequest
from pagedllm.tokenizer.chat_messages import render_chat
from pagedllm.pooling_params import (PoolingParams, check_pooling_params, check_pooling_task,
                                     resolve_truncation)
from pagedllm.sampling_params import SEED_MIN, SamplingParams
from pagedllm.structured_output.compiler import GrammarCompiler
from pagedllm.structured_output.grammar import CompiledGrammar
from pagedllm.structured_output.reasoning import (Phase, PhaseTracker, ReasoningGate,
                                                  ReasoningTokens, pick_reasoning)

PromptType = Union[str, list[int], dict[str, Any]]


@dataclass(frozen=True)
class ProcessedPrompt:
    """A validated prompt and the child requests (one per sample) made from it."""

    prompt: Optional[str]
    prompt_token_ids: list[int]
    requests: list[Request]


class InputProcessor:
    """Tokenizes prompts and checks them against the model's limits."""

    def __init__(self, tokenizer, max_model_len: int, vocab_size: int,
                 eos_token_ids: frozenset[int], block_size: int, max_logprobs: int,
                 structured_outputs: Optional[StructuredOutputsConfig] = None,
                 pooling_arch: Optional[ModelArchConfig] = None,
                 speculative: bool = False) -> None:
        """pooling_arch: the model's architecture when it pools (None: it generates);
        speculative: the engine runs speculative decoding (a request's prediction is used)."""
        self.tokenizer = tokenizer
        self.speculative = speculative
        self.pooling_arch = pooling_arch
        self.max_logprobs = max_logprobs
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.block_size = block_size
        self.grammars = GrammarCompiler(tokenizer, vocab_size, structured_outputs)
        # a thinking model's tags: a constraint starts after the thinking (None: no parser)
        self.reasoning: Optional[ReasoningTokens] = pick_reasoning(
            tokenizer, structured_outputs.reasoning_parser if structured_outputs else None)

    def process(self, request_id: str, prompt: PromptType, params: SamplingParams, *,
                max_tokens_must_fit: bool = False,
                grammar: Optional[CompiledGrammar] = None,
                lora_request: Optional[LoRARequest] = None) -> ProcessedPrompt:
        """Validate and tokenize; n > 1 becomes n child requests with distinct seeds.

        max_tokens is capped at what the context leaves after the prompt; with
        max_tokens_must_fit (the server's rule, as vLLM's) a larger one is refused instead.
        grammar: params.structured_outputs compiled already (the server awaits
        grammars.compile_async); None compiles it here, waiting on a grammar worker.
        lora_request: the adapter every sample runs with, checked already (AdapterRegistry)."""
        if self.pooling_arch is not None:
            raise ValueError("this model embeds and does not generate: use LLM.embed / "
                             "LLM.encode (the server's /v1/embeddings)")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.max_logprobs:
                raise ValueError(f"{name} must be <= {self.max_logprobs} (the engine's max_logprobs), "
                                 f"got {value}")
        self._check_vocab_ids("logit_bias keys", params.logit_bias or ())
        self._check_vocab_ids("allowed_token_ids", params.allowed_token_ids or ())
        text, ids = self._tokenize(prompt)
        self._check_length(ids)
        # never on the engine's thread: a 400 for an invalid spec, not a failed step
        if params.structured_outputs is None:
            grammar = None
        elif grammar is None:
            grammar = self.grammars.compile(params.structured_outputs)
        if grammar is not None and params.allowed_token_ids:
            _check_allowed_ids(grammar, params)
        max_tokens = self.max_model_len - len(ids)
        if params.max_tokens is not None:
            if max_tokens_must_fit and params.max_tokens > max_tokens:
                raise ValueError(
                    f"max_tokens (or max_completion_tokens) is too large: {params.max_tokens}. "
                    f"This model's maximum context length is {self.max_model_len} tokens and "
                    f"your request has {len(ids)} input tokens ({params.max_tokens} > "
                    f"{self.max_model_len} - {len(ids)})")
            max_tokens = min(max_tokens, params.max_tokens)
        predicted = self._prediction_ids(params)
        now = time.monotonic()
        budget = grammar.new_budget() if grammar is not None else None  # shared by the n samples
        requests = []
        for i in range(params.n):
            child_params = params
            if params.n > 1 and params.seed is not None:
                child_params = replace(params, seed=_child_seed(params.seed, i))
            child_id = request_id if params.n == 1 else f"{i}_{request_id}"
            request = Request(child_id, list(ids), child_params, max_tokens,
                              self.eos_token_ids, self.block_size, now,
                              lora_request=lora_request, prediction_token_ids=predicted)
            request.grammar = None if grammar is None else self._grammar_state(grammar,
                                                                                budget, ids)
            requests.append(request)
        return ProcessedPrompt(text, ids, requests)

    def _prediction_ids(self, params: SamplingParams) -> list[int]:
        """The token ids of the request's prediction ([] without one); a ValueError naming
        it when the engine does not speculate (it would change nothing)."""
        if params.prediction is None:
            return []
        if not self.speculative:
            raise ValueError("prediction is used by speculative decoding, which this engine "
                             "does not run: start it with speculative_config (serve "
                             "--speculative-config '{\"method\": \"ngram\", "
                             "\"num_speculative_tokens\": 4}')")
        ids = self.tokenizer.encode(params.prediction, add_special_tokens=False)
        if len(ids) > self.max_model_len:  # each step searches it: bounded by the context
            raise ValueError(f"prediction is {len(ids)} tokens, more than the model's context "
                             f"({self.max_model_len} tokens)")
        return list(ids)

    def process_pooling(self, request_id: str, prompt: PromptType,
                        params: Optional[PoolingParams]) -> ProcessedPrompt:
        """Validate and tokenize a pooling request: one request, its whole prompt in one step."""
        arch = self.pooling_arch
        if arch is None:
            raise ValueError("this model generates and does not embed: use LLM.generate / "
                             "LLM.chat (the server's /v1/completions, /v1/chat/completions)")
        params = check_pooling_params(params).clone()
        params.task = check_pooling_task(params.task, arch)
        params.verify(arch.hidden_size, arch.is_matryoshka, arch.matryoshka_dimensions)
        keep = resolve_truncation(params.truncate_prompt_tokens, self.max_model_len)
        text, ids = self._tokenize_pooling(prompt, keep)
        if len(ids) > self.max_model_len:
            raise ValueError(f"prompt is {len(ids)} tokens long but max_model_len is "
                             f"{self.max_model_len}: shorten the input or set "
                             "truncate_prompt_tokens")
        second = params.second_text_start
        if second is not None and second >= len(ids):
            raise ValueError(f"the pair's second text starts at token {second}, past the "
                             f"input's {len(ids)} tokens")
        # a pooling request samples nothing: its SamplingParams are the defaults, never read
        request = Request(request_id, list(ids), SamplingParams(), 0, frozenset(),
                          self.block_size, time.monotonic(), pooling_params=params)
        return ProcessedPrompt(text, ids, [request])

    def _tokenize_pooling(self, prompt: PromptType,
                          keep: Optional[int]) -> tuple[Optional[str], list[int]]:
        """A pooling prompt's ids; with keep (truncate_prompt_tokens), a longer one cut to it as
        vLLM cuts: a text by the tokenizer from the right (its special tokens kept), token ids
        to their last `keep`."""
        text, ids = self._tokenize(prompt)
        if keep is None or len(ids) <= keep:
            return text, ids
        if text is not None and not (isinstance(prompt, dict) and "prompt_token_ids" in prompt):
            return text, self.tokenizer.encode_truncated(text, None, keep)[0]
        return text, ids[-keep:]

    def _grammar_state(self, grammar: CompiledGrammar, budget: Any, ids: list[int]) -> Any:
        """A sequence's grammar state; with a reasoning parser, gated to start after the
        thinking unless the prompt already ended it (enable_thinking=false)."""
        state = grammar.new_state(budget)
        if self.reasoning is None:
            return state
        phase = self.reasoning.first_phase(ids, self.tokenizer)
        if phase is Phase.ANSWER:
            return state
        return ReasoningGate(state, PhaseTracker(self.reasoning, phase))

    def chat_prompt_ids(self, messages: list[dict[str, Any]], **options: Any) -> list[int]:
        """Token ids of a conversation through the chat template (tokenizer/chat_messages.py's
        render_chat options: chat_template, tools, documents, add_generation_prompt, ...)."""
        return render_chat(self.tokenizer, messages, **options)

    def _tokenize(self, prompt: PromptType) -> tuple[Optional[str], list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("prompt dict must have a 'prompt' (text) or 'prompt_token_ids' key, "
                                 f"got keys {sorted(prompt)}")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            ids = self.tokenizer.encode(prompt)
            if not ids:
                raise no_tokens_error("prompt")
            bad = max(ids)
            if bad >= self.vocab_size:  # a tokenizer with more ids than the model's embedding
                raise ValueError(f"prompt tokenizes to id {bad}, outside the model's vocabulary "
                                 f"[0, {self.vocab_size}): the tokenizer does not match the model")
            return prompt, ids
        if isinstance(prompt, (list, tuple)):
            return None, self._check_ids(prompt)
        raise ValueError("prompt must be a string, a list of token ids, or a dict with 'prompt' or "
                         f"'prompt_token_ids', got {type(prompt).__name__}")

    def _check_ids(self, ids: Any) -> list[int]:
        if not isinstance(ids, (list, tuple)) or not ids:
            raise ValueError("prompt_token_ids must be a non-empty list of ints")
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise ValueError(f"prompt_token_ids must be ints in [0, {self.vocab_size}), "
                                 f"got {t!r}")
        return list(ids)

    def _check_vocab_ids(self, name: str, ids: Iterable[int]) -> None:
        bad = sorted(t for t in ids if t >= self.vocab_size)
        if bad:
            raise ValueError(f"{name} must be token ids in [0, {self.vocab_size}), got {bad[:8]}")

    def _check_length(self, ids: list[int]) -> None:
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt is {len(ids)} tokens long but max_model_len is {self.max_model_len}: "
                "the prompt plus at least one generated token must fit; shorten the prompt or "
                "raise max_model_len")


def no_tokens_error(field: str) -> ValueError:
    """The refusal of a text prompt that tokenizes to nothing (the engine's and the server's)."""
    return ValueError(f"{field} tokenizes to no tokens (the tokenizer drops every character of "
                      "it); send text the tokenizer keeps, or token ids")


def _check_allowed_ids(grammar: CompiledGrammar, params: SamplingParams) -> None:
    """The constraint and allowed_token_ids must leave a first token (else no step can sample)."""
    if not grammar.allows_any(params.allowed_token_ids):
        raise ValueError(f"allowed_token_ids excludes every token that "
                         f"{params.structured_outputs.label} allows first: no output can satisfy "
                         "both; widen allowed_token_ids or drop one of them")


def _child_seed(seed: int, index: int) -> int:
    """Seed of sample `index` of an n > 1 request: seed + index, wrapped into signed 64 bits."""
    return (seed + index - SEED_MIN) % 2**64 + SEED_MIN
