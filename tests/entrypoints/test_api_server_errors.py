"""The app's last-resort error answers, in-process on the real SmolLM2 engine: an exception no
handler expected is a 500 and input nested past the interpreter's stack a 400, both OpenAI's
error object (Starlette's own would be plain text). Two routes that raise are added to the real
app for it: no request the server serves is known to reach these any more."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from conftest import API_KEY, MODEL
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.async_engine import AsyncLLM
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.entrypoints.openai.serving_common import ServerContext


@pytest.fixture(scope="module")
def app(smollm_gguf):
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(smollm_gguf), dtype="float32",
                                                   max_num_seqs=1, max_model_len=512))
    ctx = ServerContext(AsyncLLM(engine), [MODEL], 512, None)
    app = build_app(ctx, API_KEY)

    @app.get("/raise/{kind}")
    async def _raise(kind: str) -> None:
        if kind == "recursion":
            raise RecursionError("maximum recursion depth exceeded")
        raise RuntimeError("an unforeseen failure")

    yield app
    ctx.engine.shutdown()


def _get(app, path: str, **headers: str) -> httpx.Response:
    async def main():
        # raise_app_exceptions=False: Starlette re-raises a 500's exception for the server to log
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            return await client.get(path, headers=headers)

    return asyncio.run(main())


@pytest.mark.parametrize("kind,status,words", [
    ("unforeseen", 500, "internal server error: RuntimeError: an unforeseen failure"),
    ("recursion", 400, "nests too deeply"),
])
def test_unexpected_exceptions_are_openai_error_objects(app, kind, status, words):
    r = _get(app, f"/raise/{kind}", Authorization=f"Bearer {API_KEY}")
    assert r.status_code == status and r.headers["content-type"] == "application/json"
    error = r.json()["error"]
    assert words in error["message"] and error["code"] == status and error["param"] is None
    assert error["type"] == ("server_error" if status == 500 else "invalid_request_error")


def test_the_key_guards_every_route_but_the_public_ones(app):
    assert _get(app, "/raise/unforeseen").status_code == 401  # routes added later too
    assert _get(app, "/health").status_code == 200
