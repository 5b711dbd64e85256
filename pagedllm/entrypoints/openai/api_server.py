"""The OpenAI-compatible HTTP server: FastAPI routes over one AsyncLLM."""
from __future__ import annotations

import asyncio
import logging
from functools import partial
from typing import Any, Awaitable, Optional, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from pagedllm.engine.async_engine import (AsyncLLM, EngineClosingError, EngineDeadError,
                                          RequestFailedError)
from pagedllm.entrypoints.anthropic.errors import error_body
from pagedllm.entrypoints.anthropic.protocol import CountTokensRequest, MessagesRequest
from pagedllm.entrypoints.anthropic.serving_messages import count_tokens, create_message
from pagedllm.entrypoints.openai.auth import ApiKeyAuth
from pagedllm.entrypoints.openai.cohere_embed_protocol import CohereEmbedRequest
from pagedllm.entrypoints.openai.bounded_http import BoundedBodies
from pagedllm.entrypoints.openai.limits import HttpLimits
from pagedllm.entrypoints.openai.lora_modules import model_cards
from pagedllm.entrypoints.openai.serving_lora import (RUNTIME_ENV, LoadLoRAAdapterRequest,
                                                      UnloadLoRAAdapterRequest, load_lora_adapter,
                                                      runtime_updates_allowed,
                                                      unload_lora_adapter)
from pagedllm.entrypoints.openai.metrics import ServerMetrics
from pagedllm.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest,
                                                  DetokenizeRequest, TokenizeRequest)
from pagedllm.entrypoints.openai.serving_chat import conversation, create_chat_completion
from pagedllm.entrypoints.openai.embeddings_protocol import EmbeddingRequest, PoolingRequest
from pagedllm.entrypoints.openai.serving_cohere_embed import create_cohere_embedding
from pagedllm.entrypoints.openai.serving_common import (CHAT, CLASSIFY, COHERE_EMBED,
                                                        COMPLETIONS, EMBEDDINGS,
                                                        MESSAGES, POOLING, RERANK, RERANK_PATHS,
                                                        RESPONSES, SCORE, SCORE_PATHS,
                                                        OpenAIError, ServerContext,
                                                        bad_request, now)
from pagedllm.entrypoints.openai.serving_embedding import create_embedding, create_pooling
from pagedllm.entrypoints.openai.serving_scoring import (create_classify, create_rerank,
                                                         create_score)
from pagedllm.entrypoints.openai.scoring_protocol import (ClassifyRequest, RerankRequest,
                                                          ScoreRequest)
from pagedllm.entrypoints.openai.serving_completion import create_completion
from pagedllm.entrypoints.openai.responses_protocol import ResponsesRequest
from pagedllm.entrypoints.openai.serving_responses import (cancel_response, create_response,
                                                           get_response)
from pagedllm.loader.hf.pooling_files import input_type_prompts
from pagedllm.version import __version__

logger = logging.getLogger("pagedllm")
T = TypeVar("T")
CLIENT_CLOSED = 499  # nginx's status for a request whose client went away; nobody reads it


def _validation_message(err: RequestValidationError) -> tuple[str, Optional[str]]:
    first = err.errors()[0] if err.errors() else {}
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    # a whole-body check (protocol.RequestBody) names its field in ctx
    field = ".".join(loc) or (first.get("ctx") or {}).get("field")
    return f"{field or 'body'}: {first.get('msg', 'invalid value')}", field


def _routing_error(request: Request, err: HTTPException) -> OpenAIError:
    """Starlette's and FastAPI's HTTP errors as OpenAI errors: 404 (no such path), 405 (wrong
    method), FastAPI's 400 for a body it cannot parse, bounded_http's 408 and 413."""
    where = f"{request.method} {request.url.path}"
    if err.status_code == 404:
        return OpenAIError(f"{where}: no such endpoint", 404)
    if err.status_code == 405:
        allowed = (err.headers or {}).get("Allow", "")
        return OpenAIError(f"{where}: method not allowed; this path takes {allowed}", 405)
    if isinstance(err.__cause__, RecursionError):  # FastAPI's JSON parsing of the body
        return OpenAIError(f"{where}: the request body nests JSON arrays or objects too deeply",
                           400)
    if err.__cause__ is not None:
        return OpenAIError(f"{where}: {err.detail}: {err.__cause__}", err.status_code)
    return OpenAIError(f"{where}: {err.detail}", err.status_code)


async def _until_disconnect(request: Request) -> None:
    """Return when the client goes away. The handler has read the body, so the next ASGI
    message is http.disconnect: this waits on it without polling."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> Optional[T]:
    """work's result, or None once the client disconnects first. Cancelling work closes its
    output streams, which aborts the requests and frees their KV blocks (a streaming
    response's body does the same on its own)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():  # the client went first (or this handler was cancelled)
            task.cancel()
    return task.result() if task.done() else None


def build_app(ctx: ServerContext, api_key: Optional[str] = None,
              limits: HttpLimits = HttpLimits()) -> FastAPI:
    """The FastAPI application. Every error it answers is OpenAI's error object (Anthropic's
    under /v1/messages)."""
    app = FastAPI(title="pagedllm", version=__version__)
    metrics = ServerMetrics(ctx.engine, ctx.served_model_names[0])
    ctx.engine.listener = metrics

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, err: OpenAIError) -> JSONResponse:
        return _error(request, err)

    @app.exception_handler(RequestFailedError)
    @app.exception_handler(EngineDeadError)
    async def _failed(request: Request, err: RuntimeError) -> JSONResponse:
        # this request failed on its own, or the engine stopped (serve then exits)
        return _error(request, OpenAIError(str(err), 500))

    @app.exception_handler(EngineClosingError)
    async def _closing(request: Request, err: EngineClosingError) -> JSONResponse:
        return _error(request, OpenAIError(str(err), 503))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        message, field = _validation_message(err)
        return _error(request, OpenAIError(message, 400, field))

    @app.exception_handler(HTTPException)
    async def _routing(request: Request, err: HTTPException) -> JSONResponse:
        return _error(request, _routing_error(request, err), err.headers)

    @app.exception_handler(RecursionError)
    async def _too_deep(request: Request, err: RecursionError) -> JSONResponse:
        # only input nested beyond the interpreter's stack gets here (a template's tojson of a
        # deep tools object, say)
        return _error(request, OpenAIError(f"the request nests too deeply to process: {err}", 400))

    @app.exception_handler(Exception)
    async def _internal(request: Request, err: Exception) -> JSONResponse:
        # Starlette re-raises err after this answer: uvicorn logs its traceback
        return _error(request, OpenAIError(
            f"internal server error: {type(err).__name__}: {err}", 500))

    @app.get("/health")
    async def health() -> Response:
        problem = unhealthy(ctx.engine)
        if problem is None:
            return Response(status_code=200)
        return JSONResponse(OpenAIError(problem, 503).body(), status_code=503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        # what the model serves (vLLM's runner) and where; then its LoRA adapters
        card = {"object": "model", "created": now(), "owned_by": "pagedllm",
                "max_model_len": ctx.max_model_len, "runner": ctx.runner,
                "endpoints": ctx.endpoints()}
        return {"object": "list", "data": [
            c for name in ctx.served_model_names
            for c in model_cards(name, ctx.lora_modules if name == ctx.served_model_names[0]
                                 else {}, card)]}

    @app.post(COMPLETIONS)
    async def completions(req: CompletionRequest, raw: Request):
        ctx.check_serves(COMPLETIONS)
        return _respond(await _unless_disconnected(
            raw, create_completion(ctx, req, _client(raw))))

    @app.post(CHAT)
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        ctx.check_serves(CHAT)
        return _respond(await _unless_disconnected(
            raw, create_chat_completion(ctx, req, _client(raw))))

    @app.post(RESPONSES)
    async def responses(req: ResponsesRequest, raw: Request):
        ctx.check_serves(RESPONSES)
        return _respond(await _unless_disconnected(
            raw, create_response(ctx, req, _client(raw))))

    _add_pooling_routes(app, ctx)
    if runtime_updates_allowed():
        _add_lora_routes(app, ctx)

    @app.get("/v1/responses/{response_id}")
    async def response(response_id: str) -> dict[str, Any]:
        return get_response(ctx, response_id)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel(response_id: str) -> dict[str, Any]:
        return cancel_response(ctx, response_id)

    @app.post(MESSAGES)
    async def messages(req: MessagesRequest, raw: Request):
        ctx.check_serves(MESSAGES)
        return _respond(await _unless_disconnected(
            raw, create_message(ctx, req, _client(raw))))

    @app.post(MESSAGES + "/count_tokens")
    async def messages_count_tokens(req: CountTokensRequest) -> dict[str, int]:
        ctx.check_serves(MESSAGES)
        return await count_tokens(ctx, req)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict[str, Any]:
        ctx.check_model(req.model)
        tok = ctx.engine.tokenizer
        try:
            if req.messages is not None:
                ids = await ctx.tokens.run(partial(
                    ctx.engine.chat_prompt_ids, chat_template=ctx.chat_template,
                    add_generation_prompt=req.add_generation_prompt), conversation(req.messages))
            elif req.prompt is not None:
                (ids,) = await ctx.tokens.encode([req.prompt], ["prompt"], req.add_special_tokens)
            else:
                raise OpenAIError("send 'prompt' or 'messages'", 400, "prompt")
        except ValueError as err:
            raise bad_request(err) from None
        out = {"tokens": ids, "count": len(ids), "max_model_len": ctx.max_model_len}
        if req.return_token_strs:
            out["token_strs"] = await ctx.tokens.run(tok.convert_ids_to_tokens, ids)
        return out

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict[str, str]:
        ctx.check_model(req.model)
        vocab = ctx.engine.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise OpenAIError(f"tokens must be ids in [0, {vocab}), got {bad[0]}", 400, "tokens")
        return {"prompt": await ctx.tokens.run(ctx.engine.tokenizer.decode, req.tokens)}

    if api_key:
        app.add_middleware(ApiKeyAuth, api_key=api_key)
    app.add_middleware(BoundedBodies, limits=limits)  # added last: the outermost
    return app


def _add_lora_routes(app: FastAPI, ctx: ServerContext) -> None:
    """vLLM's runtime adapter endpoints (VLLM_ALLOW_RUNTIME_LORA_UPDATING)."""
    logger.warning("%s is set: /v1/load_lora_adapter and /v1/unload_lora_adapter let API "
                   "callers load adapters from this machine's paths", RUNTIME_ENV)

    @app.post("/v1/load_lora_adapter")
    async def load_adapter(req: LoadLoRAAdapterRequest) -> Response:
        return Response(await load_lora_adapter(ctx, req), media_type="text/plain")

    @app.post("/v1/unload_lora_adapter")
    async def unload_adapter(req: UnloadLoRAAdapterRequest) -> Response:
        return Response(unload_lora_adapter(ctx, req), media_type="text/plain")


def _add_pooling_routes(app: FastAPI, ctx: ServerContext) -> None:
    """A pooling model's endpoints: /v1/embeddings, Cohere's /v2/embed, vLLM's /pooling,
    /score (and /v1/score), /rerank (and Jina's /v1/rerank, Cohere's /v2/rerank) and /classify;
    each refuses a model it does not serve, naming those that do."""
    @app.post(EMBEDDINGS)
    async def embeddings(req: EmbeddingRequest, raw: Request):
        ctx.check_serves(EMBEDDINGS)
        return _respond(await _unless_disconnected(raw, create_embedding(ctx, req, _client(raw))))

    # read once, at start: a checkpoint's files do not change under a running server
    prompts = (input_type_prompts(ctx.engine.engine.config.model_path)
               if ctx.runner == "pooling" else {})

    @app.post(COHERE_EMBED)
    async def cohere_embed(req: CohereEmbedRequest, raw: Request):
        ctx.check_serves(COHERE_EMBED)
        return _respond(await _unless_disconnected(raw, create_cohere_embedding(ctx, req,
                                                                                prompts)))

    @app.post(POOLING)
    async def pooling(req: PoolingRequest, raw: Request):
        ctx.check_serves(POOLING)
        return _respond(await _unless_disconnected(raw, create_pooling(ctx, req)))

    for path in SCORE_PATHS:
        @app.post(path)
        async def score(req: ScoreRequest, raw: Request):
            ctx.check_serves(SCORE)
            return _respond(await _unless_disconnected(raw, create_score(ctx, req)))

    for path in RERANK_PATHS:
        @app.post(path)
        async def rerank(req: RerankRequest, raw: Request):
            ctx.check_serves(RERANK)
            return _respond(await _unless_disconnected(raw, create_rerank(ctx, req)))

    @app.post(CLASSIFY)
    async def classify(req: ClassifyRequest, raw: Request):
        ctx.check_serves(CLASSIFY)
        return _respond(await _unless_disconnected(raw, create_classify(ctx, req)))


def _client(request: Request) -> Optional[str]:
    """Who sent the request, for --max-client-share: the peer's address (client_share)."""
    return request.client.host if request.client is not None else None


def unhealthy(engine: AsyncLLM) -> Optional[str]:
    """Why /health answers 503 (the engine stopped or hung, the server drains), or None."""
    if engine.error is not None:
        return f"the engine stopped: {type(engine.error).__name__}: {engine.error}"
    return engine.closing


def _error(request: Request, err: OpenAIError,
           headers: Optional[dict[str, str]] = None) -> JSONResponse:
    """err answered in the shape of the API the path belongs to (OpenAI's or Anthropic's)."""
    return JSONResponse(error_body(request.url.path, err), status_code=err.status,
                        headers=headers)


def _respond(result: Any):
    if result is None:  # the client disconnected
        return Response(status_code=CLIENT_CLOSED)
    if isinstance(result, dict):
        return JSONResponse(result)
    return StreamingResponse(result, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def load_chat_template(path: Optional[str]) -> Optional[str]:
    """--chat-template: a file with a Jinja template (or the template text itself)."""
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except OSError:
        if "{%" in path or "{{" in path:
            return path
        raise ValueError(f"--chat-template {path!r}: no such file") from None


__all__ = ["build_app", "load_chat_template"]
