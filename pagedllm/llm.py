"""LLM: vLLM's offline API (generate, chat; embed, encode, classify, score for pooling
models) over the engine."""
from __future__ import annotations

import inspect
import itertools
import time
from dataclasses import fields, replace
from typing import Any, Optional, Sequence, Union

from tqdm.auto import tqdm

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.input_processor import PromptType
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.tokenizer.hf_tokenizer import to_transformers
from pagedllm.logger import configure_logging
from pagedllm.lora.request import LoRARequest
from pagedllm.engine.scoring import as_texts, cosine, pair_requests, pair_up
from pagedllm.outputs import (ClassificationRequestOutput, EmbeddingRequestOutput,
                              PoolingRequestOutput, RequestOutput, ScoringOutput,
                              ScoringRequestOutput)
from pagedllm.pooling_params import (POOLING_TASKS, PoolingParams, check_pooling_params,
                                     check_pooling_task)
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

Conversation = list[dict[str, Any]]


def _signature() -> inspect.Signature:
    """LLM(model, *, tokenizer=None, dtype="auto", ...): EngineArgs' fields and defaults, spelled
    once there, as LLM's keyword arguments (for help(), IDEs and inspect)."""
    keyword = inspect.Parameter.KEYWORD_ONLY
    return inspect.Signature(
        [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
         inspect.Parameter("model", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=str)]
        + [inspect.Parameter(f.name, keyword, default=f.default, annotation=f.type)
           for f in fields(EngineArgs) if f.name != "model"]
        + [inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)],
        return_annotation=None)


class LLM:
    """An offline engine: LLM(model=...).generate(prompts, SamplingParams(...)).

    It logs at INFO to stderr (device, dtype, kernels, memory plan) unless the application has
    set up logging; PAGEDLLM_LOGGING_LEVEL changes the level."""

    def __init__(self, model: str, **kwargs: Any) -> None:
        """Keyword arguments are EngineArgs' fields (vLLM's names, with their defaults there:
        inspect.signature(LLM) lists them) and vLLM's options this engine ignores (a warning
        each); any other is a TypeError naming it."""
        configure_logging()
        args = EngineArgs.from_kwargs(model, **kwargs)
        self.llm_engine = LLMEngine.from_engine_args(args)
        self._counter = itertools.count()
        self._transformers_tokenizer: Any = None

    def get_tokenizer(self) -> Any:
        """The engine's tokenizer as transformers' PreTrainedTokenizerFast, as vLLM gives it:
        built on the first call (importing transformers, ~1 s), then kept. The engine itself
        runs on pagedllm's FastTokenizer (llm_engine.tokenizer), which behaves the same."""
        if self._transformers_tokenizer is None:
            self._transformers_tokenizer = to_transformers(self.llm_engine.tokenizer)
        return self._transformers_tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """Sampling defaults from the model's generation_config.json, else vLLM's defaults."""
        return self.llm_engine.default_sampling_params()

    def generate(self, prompts: Union[PromptType, Sequence[PromptType]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 use_tqdm: bool = True,
                 lora_request: Union[LoRARequest, Sequence[LoRARequest], None] = None
                 ) -> list[RequestOutput]:
        """Complete each prompt; outputs come back in input order. lora_request: one LoRA
        adapter for every prompt, or one (or None) per prompt (enable_lora)."""
        prompt_list = _as_prompt_list(prompts)
        params = self._params_list(sampling_params, len(prompt_list))
        loras = _per_prompt(lora_request, len(prompt_list), LoRARequest, "lora_request", None)
        return self._run(prompt_list, params, use_tqdm, loras)

    def chat(self, messages: Union[Conversation, Sequence[Conversation]],
             sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
             use_tqdm: bool = True,
             lora_request: Union[LoRARequest, Sequence[LoRARequest], None] = None,
             chat_template: Optional[str] = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: Optional[dict[str, Any]] = None,
             tools: Optional[list[dict[str, Any]]] = None) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation (rendering `tools`, OpenAI
        function tools, as the template does), then generate; the text is not parsed for calls.
        lora_request as generate() takes it."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for conv in conversations:
            _check_conversation(conv)
            ids = self.llm_engine.input_processor.chat_prompt_ids(
                conv, chat_template=chat_template, tools=tools,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template_kwargs=chat_template_kwargs)
            prompts.append({"prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def encode(self, prompts: Union[PromptType, Sequence[PromptType]],
               pooling_params: Union[PoolingParams, Sequence[PoolingParams], None] = None,
               use_tqdm: bool = True, pooling_task: Optional[str] = None
               ) -> list[PoolingRequestOutput]:
        """Pool each prompt (a pooling model only); outputs come back in input order, each
        `.outputs.data` a float32 tensor. pooling_task: "embed", "classify" or "score" (None:
        each PoolingParams' task, else the model's own: embed, or classify with a head)."""
        if pooling_task is not None and pooling_task not in POOLING_TASKS:
            raise ValueError(f"pooling_task={pooling_task!r} is not supported; supported: "
                             f"{', '.join(POOLING_TASKS)}")
        prompt_list = _as_prompt_list(prompts)
        params = _pooling_params_list(pooling_params, len(prompt_list))
        if pooling_task is not None:
            params = [_with_task(p, pooling_task) for p in params]
        return self._pool(list(zip(prompt_list, params)), use_tqdm)

    def embed(self, prompts: Union[PromptType, Sequence[PromptType]],
              pooling_params: Union[PoolingParams, Sequence[PoolingParams], None] = None,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """Embed each prompt (a pooling model only); `.outputs.embedding` is a list of floats."""
        return [EmbeddingRequestOutput.from_base(o)
                for o in self.encode(prompts, pooling_params, use_tqdm, pooling_task="embed")]

    def classify(self, prompts: Union[PromptType, Sequence[PromptType]], *,
                 pooling_params: Union[PoolingParams, Sequence[PoolingParams], None] = None,
                 use_tqdm: bool = True) -> list[ClassificationRequestOutput]:
        """Each prompt's class probabilities (a model with a classification head):
        `.outputs.probs`, one per label in the head's order."""
        return [ClassificationRequestOutput.from_base(o)
                for o in self.encode(prompts, pooling_params, use_tqdm, pooling_task="classify")]

    def score(self, data_1: Union[str, Sequence[str]], data_2: Union[str, Sequence[str]], /, *,
              truncate_prompt_tokens: Optional[int] = None, use_tqdm: bool = True,
              pooling_params: Optional[PoolingParams] = None) -> list[ScoringRequestOutput]:
        """The relevance of each (data_1, data_2) pair: one data_1 text against every data_2
        text, or the two lists side by side. A cross-encoder (one-label head) reads each pair
        as one input; an embedding model scores the cosine of the two texts' embeddings."""
        first, second = as_texts(data_1, "data_1"), as_texts(data_2, "data_2")
        pairs = pair_up(first, second, ("data_1", "data_2"))
        params = check_pooling_params(pooling_params).clone()
        if truncate_prompt_tokens is not None:
            params = replace(params, truncate_prompt_tokens=truncate_prompt_tokens)
        engine = self.llm_engine
        arch = engine.input_processor.pooling_arch
        if arch is not None and arch.num_labels:
            check_pooling_task("score", arch)
            prompts = pair_requests(engine.tokenizer, pairs, engine.input_processor.max_model_len,
                                    params)
            outs = self._pool(prompts, use_tqdm)
            return [ScoringRequestOutput(o.request_id, ScoringOutput(float(o.outputs.data[0])),
                                         o.prompt_token_ids) for o in outs]
        params.task = "embed"
        texts = list(dict.fromkeys(first + second))  # each distinct text embedded once
        outs = dict(zip(texts, self._pool([(t, params) for t in texts], use_tqdm)))
        return [ScoringRequestOutput(f"{outs[a].request_id}_{outs[b].request_id}",
                                     ScoringOutput(cosine(outs[a].outputs.data,
                                                          outs[b].outputs.data)),
                                     outs[a].prompt_token_ids + outs[b].prompt_token_ids)
                for a, b in pairs]

    def _pool(self, prompts: list[tuple[PromptType, Optional[PoolingParams]]],
              use_tqdm: bool) -> list[PoolingRequestOutput]:
        """Run pooling requests to the end; outputs in input order."""
        engine = self.llm_engine
        ids = [str(next(self._counter)) for _ in prompts]
        finished: dict[str, PoolingRequestOutput] = {}
        try:
            for request_id, (prompt, p) in zip(ids, prompts):
                engine.add_pooling_request(request_id, prompt, p)
            with tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm) as bar:
                while len(finished) < len(ids):
                    for out in engine.step():
                        finished[out.request_id] = out
                        bar.update(1)
        finally:  # an error or Ctrl-C leaves no request behind
            leftover = [r for r in ids if r not in finished]
            if leftover:
                engine.abort_request(leftover)
        failed = [finished[r] for r in ids if finished[r].error is not None]
        if failed:
            raise RuntimeError(f"request {failed[0].request_id} failed: {failed[0].error}")
        return [finished[r] for r in ids]

    # ---- helpers ------------------------------------------------------------
    def _params_list(self, sampling_params, n: int) -> list[SamplingParams]:
        default = self.get_default_sampling_params() if sampling_params is None else None
        return _per_prompt(sampling_params, n, SamplingParams, "sampling_params", default)

    def _run(self, prompts: list[PromptType], params: list[SamplingParams],
             use_tqdm: bool, loras: list[Optional[LoRARequest]]) -> list[RequestOutput]:
        engine = self.llm_engine
        ids = [str(next(self._counter)) for _ in prompts]
        added: list[str] = []
        finished: dict[str, RequestOutput] = {}
        # only the finished outputs are returned, so the engine makes no others (as vLLM's LLM);
        # one copy per distinct params object
        distinct = {id(p): p for p in params if isinstance(p, SamplingParams)}
        final_only = {key: _final_only(p) for key, p in distinct.items()}
        try:
            for request_id, prompt, p, lora in zip(ids, prompts, params, loras):
                engine.add_request(request_id, prompt, final_only.get(id(p), p), lora)
                added.append(request_id)
            with tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm) as bar:
                speed = _Speed(bar)
                while len(finished) < len(ids):
                    for out in engine.step():
                        if out.finished:
                            finished[out.request_id] = out
                            speed.finished(out)
        finally:  # an error or Ctrl-C leaves no request (or KV block) behind
            leftover = [r for r in added if r not in finished]
            if leftover:
                engine.abort_request(leftover)
        return [finished[r] for r in ids]


def _per_prompt(params: Any, n: int, cls: type, field: str, default: Any) -> list[Any]:
    """One params object per prompt: `default` for None, the one given for every prompt, or a
    list of n; another count is a ValueError naming `field`."""
    if params is None or isinstance(params, cls):
        return [default if params is None else params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"{field} has {len(params)} entries but there are {n} prompts; "
                         f"pass one {cls.__name__} or one per prompt")
    return params


def _pooling_params_list(params: Any, n: int) -> list[Optional[PoolingParams]]:
    """One PoolingParams (or None: the model's defaults) per prompt."""
    return _per_prompt(params, n, PoolingParams, "pooling_params", None)


def _with_task(params: Optional[PoolingParams], task: str) -> PoolingParams:
    """A copy of params (None: the defaults) asking for task; a different task already set is
    a ValueError naming both."""
    params = check_pooling_params(params)
    if params.task is not None and params.task != task:
        raise ValueError(f"pooling_params.task={params.task!r} but this call runs {task!r}")
    copy = params.clone()
    copy.task = task
    return copy


def _final_only(params: SamplingParams) -> SamplingParams:
    """A copy of params whose request outputs only once, finished."""
    copy = params.clone()
    copy.output_kind = RequestOutputKind.FINAL_ONLY
    return copy


class _Speed:
    """Advances the progress bar per finished request and shows input and output tok/s so far,
    as vLLM's bar does."""

    def __init__(self, bar: tqdm) -> None:
        self.bar = bar
        self.started = time.perf_counter()
        self.input_tokens = self.output_tokens = 0

    def finished(self, out: RequestOutput) -> None:
        """One more request done."""
        self.input_tokens += len(out.prompt_token_ids)
        self.output_tokens += sum(len(c.token_ids) for c in out.outputs)
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        self.bar.set_postfix_str(f"est. speed input: {self.input_tokens / elapsed:.2f} toks/s, "
                                 f"output: {self.output_tokens / elapsed:.2f} toks/s",
                                 refresh=False)
        self.bar.update(1)


def _as_prompt_list(prompts: Any) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [prompts]  # one prompt given as token ids
    if not prompts:
        raise ValueError("prompts must not be empty")
    return prompts


def _check_conversation(conv: Any) -> None:
    if not isinstance(conv, list) or not conv:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    for i, m in enumerate(conv):
        if not isinstance(m, dict) or "role" not in m:
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content'")
        if m["role"] not in ("system", "user", "assistant", "tool", "developer"):
            raise ValueError(f"messages[{i}].role must be one of system, user, assistant, tool, "
                             f"got {m['role']!r}")


LLM.__init__.__signature__ = _signature()  # type: ignore[attr-defined]
