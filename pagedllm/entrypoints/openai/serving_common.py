"""Pieces shared by the completion and chat handlers: errors, usage, SSE framing, sub-requests."""
from __future__ import annotations

import dataclasses
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional

from pagedllm.engine.async_engine import (AsyncLLM, EngineClosingError, EngineDeadError,
                                          EngineOverloadedError, StreamBackloggedError)
from pagedllm.engine.input_processor import PromptType
from pagedllm.entrypoints.openai.client_share import ClientShares, ShareRefused
from pagedllm.entrypoints.openai.prompt_tokens import PromptTokens
from pagedllm.entrypoints.openai.protocol import MAX_N
from pagedllm.entrypoints.openai.response_store import ResponseStore
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import RequestOutput
from pagedllm.pooling_params import model_tasks
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output.compile_pool import CompileBusyError
from pagedllm.structured_output.grammar import CompiledGrammar
from pagedllm.structured_output.reasoning import ReasoningTokens


class OpenAIError(Exception):
    """An error answered as OpenAI's error object with an HTTP status."""

    def __init__(self, message: str, status: int = 400, param: Optional[str] = None,
                 err_type: Optional[str] = None) -> None:
        super().__init__(message)
        self.message, self.status, self.param = message, status, param
        self.err_type = err_type or {401: "authentication_error", 404: "not_found_error",
                                     503: "service_unavailable"}.get(
            status, "invalid_request_error" if status < 500 else "server_error")

    def renamed(self, names: dict[str, str]) -> "OpenAIError":
        """This error in another API's field names (the chat path's -> the Responses or the
        Messages API's): its param, and the field its message starts with."""
        message = self.message
        for old, new in names.items():
            if message.startswith(old + " ") or message.startswith(old + ":"):
                message = new + message[len(old):]
                break
        return OpenAIError(message, self.status, names.get(self.param or "", self.param),
                           self.err_type)

    def body(self) -> dict[str, Any]:
        """The JSON body."""
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param,
                          "code": self.status}}


COMPLETIONS, CHAT, RESPONSES = "/v1/completions", "/v1/chat/completions", "/v1/responses"
EMBEDDINGS = "/v1/embeddings"
COHERE_EMBED = "/v2/embed"  # Cohere's embed API (vLLM's): input_type picks the model's prompt
# pooling models' other endpoints (vLLM's): a pair's relevance, a query's documents ranked
# (also at Jina's /v1/rerank and Cohere's /v2/rerank), a head's class probabilities
SCORE, RERANK, CLASSIFY, POOLING = "/score", "/rerank", "/classify", "/pooling"
SCORE_PATHS, RERANK_PATHS = (SCORE, "/v1/score"), (RERANK, "/v1/rerank", "/v2/rerank")
MESSAGES = "/v1/messages"  # Anthropic's Messages API, over the chat path


@dataclass
class ServerContext:
    """What every handler needs: the engine and the names it answers to."""

    engine: AsyncLLM
    served_model_names: list[str]
    max_model_len: int
    chat_template: Optional[str]
    tool_parser: Optional[str] = None  # --tool-call-parser, else the one the template implies
    enable_auto_tool_choice: bool = False
    exclude_tools_when_tool_choice_none: bool = False
    client_shares: Optional[ClientShares] = None  # --max-client-share; None: no cap
    # --reasoning-parser's tags (or the chat template's): reasoning split from the answer
    reasoning: Optional[ReasoningTokens] = None
    # /v1/responses: stored responses (store=true) and the running ones (cancel)
    responses: ResponseStore = field(default_factory=ResponseStore)
    # --lora-modules: adapter name (a request's `model`) -> the adapter, checked at start
    lora_modules: dict[str, LoRARequest] = field(default_factory=dict)
    tokens: PromptTokens = field(init=False)  # tokenizing off the event loop, length-bounded

    def __post_init__(self) -> None:
        self.tokens = PromptTokens(self.engine.tokenizer, self.max_model_len)

    @property
    def runner(self) -> str:
        """What the model serves: "generate" (completions, chat, responses, messages) or
        "pooling" (embeddings)."""
        return self.engine.engine.config.runner

    @property
    def labels(self) -> int:
        """Outputs of the pooling model's classification head (0: none, or a generator)."""
        return self.engine.engine.config.arch.num_labels

    def endpoints(self) -> list[str]:
        """The endpoints that serve this model."""
        if self.runner != "pooling":
            return [COMPLETIONS, CHAT, RESPONSES, MESSAGES]
        tasks = model_tasks(self.labels)
        out = [EMBEDDINGS, COHERE_EMBED, POOLING] if "embed" in tasks else [CLASSIFY, POOLING]
        if "embed" in tasks or "score" in tasks:  # an embedder scores by cosine
            out += [*SCORE_PATHS, *RERANK_PATHS]
        return out

    def check_serves(self, endpoint: str) -> None:
        """A 400 naming the endpoints that serve this model when `endpoint` does not."""
        if endpoint in self.endpoints():
            return
        pooling = ("an embedding (pooling) model" if not self.labels else
                   f"a classification (pooling) model with {self.labels} label"
                   f"{'s' if self.labels > 1 else ''}")
        kind = pooling if self.runner == "pooling" else "a text generation model; it does not pool"
        raise OpenAIError(f"{endpoint} does not serve this model: it is {kind}; "
                          f"{', '.join(self.endpoints())} serve it", 400, "model")

    def check_model(self, model: Optional[str]) -> str:
        """The served name for a request's `model` (the base model's or a LoRA adapter's);
        404 for an unknown one."""
        if model is None:
            return self.served_model_names[0]
        if model not in self.served_model_names and model not in self.lora_modules:
            served = [*self.served_model_names, *self.lora_modules]
            raise OpenAIError(f"The model `{model}` does not exist; this server serves "
                              f"{', '.join(served)}", 404, "model")
        return model

    def lora_for(self, model: str) -> Optional[LoRARequest]:
        """The LoRA adapter a served name runs (None: the base model)."""
        return self.lora_modules.get(model)


def bad_request(err: ValueError) -> OpenAIError:
    """A 400 for a ValueError whose message starts with the offending field's name."""
    message = str(err)
    param = message.split(" ", 1)[0] if message and message[0].isalpha() else None
    return OpenAIError(message, 400, param)


def check_n(n: int, best_of: Optional[int]) -> None:
    """n and best_of within the server's limit."""
    for name, value in (("n", n), ("best_of", best_of)):
        if value is not None and value > MAX_N:
            raise OpenAIError(f"{name} must be <= {MAX_N}, got {value}", 400, name)


def new_id(prefix: str) -> str:
    """A request id like cmpl-3f2a..."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    """`created` timestamp."""
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int,
          reasoning_tokens: Optional[int] = None) -> dict[str, Any]:
    """The usage object; with reasoning_tokens (a reasoning parser is on), OpenAI's
    completion_tokens_details.reasoning_tokens too."""
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                           "total_tokens": prompt_tokens + completion_tokens}
    if reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return out


def sse(data: Any) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def check_prompt_count(engine: AsyncLLM, count: int) -> None:
    """A 400 naming prompt for a list longer than the waiting limit: no retry could queue it
    (503 is for a server busy with others' requests)."""
    if count > engine.max_waiting:
        raise OpenAIError(f"prompt has {count} prompts; this server queues at most "
                          f"{engine.max_waiting} requests (--max-waiting): send at most that "
                          "many per request", 400, "prompt")


async def compile_grammar(engine: AsyncLLM, params: SamplingParams) -> Optional[CompiledGrammar]:
    """The request's constraint compiled off the event loop: a 400 naming the field (invalid,
    over a cap, over the time limit), a 503 when every grammar worker is busy."""
    try:
        return await engine.compile_grammar(params)
    except ValueError as err:
        raise bad_request(err) from None
    except CompileBusyError as err:
        raise OpenAIError(str(err), 503) from None


async def start_prompts(ctx: ServerContext, prompts: list[PromptType], params: SamplingParams,
                        request_id: str, client: Optional[str] = None,
                        grammar: Optional[CompiledGrammar] = None,
                        lora: Optional[LoRARequest] = None
                        ) -> list[AsyncIterator[RequestOutput]]:
    """Queue every prompt (sub-request ids request_id-0, -1, ...) or none: a bad prompt is a
    400 and the ones already queued are aborted. The sequences count against client's share
    (ClientShares: past it the request waits for the client's own; 429 when too many wait)
    until each sub-request's stream ends. grammar: from compile_grammar; lora: the adapter the
    request's model names."""
    engine, shares = ctx.engine, ctx.client_shares if client is not None else None
    if shares is not None:
        try:
            await shares.take(client, len(prompts) * params.n,
                              "prompt" if len(prompts) > 1 else "n")
        except ShareRefused as err:
            raise OpenAIError(str(err), err.status, err.param,
                              "rate_limit_exceeded" if err.status == 429 else None) from None
    release = None if shares is None else (lambda: shares.give_back(client, params.n))
    streams: list[AsyncIterator[RequestOutput]] = []
    try:
        for i, prompt in enumerate(prompts):
            streams.append(engine.add_request(f"{request_id}-{i}", prompt, params,
                                              max_tokens_must_fit=True, on_close=release,
                                              grammar=grammar, lora_request=lora))
    except BaseException as err:
        if shares is not None:  # the queued ones give theirs back as they are aborted
            shares.give_back(client, (len(prompts) - len(streams)) * params.n)
        for i in range(len(streams)):
            engine.abort(f"{request_id}-{i}")
        if isinstance(err, ValueError):
            raise bad_request(err) from None
        if isinstance(err, (EngineOverloadedError, CompileBusyError)):
            raise OpenAIError(str(err), 503) from None
        if isinstance(err, EngineDeadError):
            raise OpenAIError(str(err), 500) from None
        raise
    return streams


def stream_error(err: Exception) -> OpenAIError:
    """The error event that ends a stream: a request aborted for a client that did not read is
    408, one the server's drain cut 503, any other failure mid-stream (the request's or the
    engine's) 500."""
    if isinstance(err, OpenAIError):
        return err
    status = (408 if isinstance(err, StreamBackloggedError)
              else 503 if isinstance(err, EngineClosingError) else 500)
    return OpenAIError(str(err), status)


def prompt_logprobs_json(out: RequestOutput) -> Optional[list]:
    """vLLM's prompt_logprobs: per prompt token None or {id: {logprob, rank, decoded_token}}."""
    if out.prompt_logprobs is None:
        return None
    return [None if lp is None else {str(t): dataclasses.asdict(v) for t, v in lp.items()}
            for lp in out.prompt_logprobs]
