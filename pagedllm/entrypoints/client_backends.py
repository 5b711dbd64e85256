"""Where `pagedllm chat` and `pagedllm complete` get tokens: a running server, or an in-process engine."""
from __future__ import annotations

import itertools
import json
from typing import TYPE_CHECKING, Any, Iterator, Optional

import httpx

from pagedllm.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from pagedllm.engine.arg_utils import EngineArgs


class ServerBackend:
    """Streams from an OpenAI-compatible server (pagedllm, vLLM, llama.cpp, ...)."""

    def __init__(self, url: str, api_key: Optional[str] = None, model: Optional[str] = None) -> None:
        self.base = url.rstrip("/")
        if not self.base.endswith("/v1"):
            self.base += "/v1"
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.model = model or self._first_model()

    def _first_model(self) -> str:
        try:
            r = httpx.get(f"{self.base}/models", headers=self.headers, timeout=10)
        except httpx.HTTPError as err:
            raise ConnectionError(f"cannot reach {self.base}: {err}") from None
        if r.status_code != 200:
            raise ConnectionError(f"{self.base}/models answered {r.status_code}: {r.text[:200]}")
        return r.json()["data"][0]["id"]

    def _stream(self, path: str, body: dict[str, Any], pick) -> Iterator[str]:
        try:
            yield from self._stream_from(path, {**body, "model": self.model, "stream": True}, pick)
        except httpx.TransportError as err:  # the server went away
            raise ConnectionError(f"cannot reach {self.base}: {err}") from None

    def _stream_from(self, path: str, body: dict[str, Any], pick) -> Iterator[str]:
        with httpx.stream("POST", f"{self.base}{path}", json=body, headers=self.headers,
                          timeout=None) as resp:
            if resp.status_code != 200:
                resp.read()
                raise RuntimeError(f"server answered {resp.status_code}: {resp.text[:500]}")
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    raise RuntimeError(data["error"].get("message", str(data["error"])))
                for choice in data.get("choices", []):
                    text = pick(choice)
                    if text:
                        yield text

    def complete(self, prompt: str, max_tokens: int, temperature: float) -> Iterator[str]:
        """Stream a completion's text."""
        return self._stream("/completions", {"prompt": prompt, "max_tokens": max_tokens,
                                             "temperature": temperature},
                            lambda c: c.get("text"))

    def chat(self, messages: list[dict[str, str]], max_tokens: Optional[int],
             temperature: float) -> Iterator[str]:
        """Stream a chat reply's text."""
        return self._stream("/chat/completions", {"messages": messages, "max_tokens": max_tokens,
                                                  "temperature": temperature},
                            lambda c: (c.get("delta") or {}).get("content"))


class LocalBackend:
    """Streams from an engine in this process."""

    def __init__(self, engine_args: EngineArgs) -> None:
        from pagedllm.engine.llm_engine import LLMEngine

        self.engine = LLMEngine.from_engine_args(engine_args)
        self._ids = itertools.count()

    def _stream(self, prompt, params: SamplingParams) -> Iterator[str]:
        rid = f"cli-{next(self._ids)}"
        params.output_kind = RequestOutputKind.DELTA  # each output holds only the new text
        self.engine.add_request(rid, prompt, params)
        finished = False
        try:
            while not finished:
                for out in self.engine.step():
                    if out.request_id != rid:
                        continue
                    if out.outputs and out.outputs[0].text:
                        yield out.outputs[0].text
                    finished = out.finished
        finally:
            if not finished:  # Ctrl-C or the caller stopped reading
                self.engine.abort_request([rid])

    def complete(self, prompt: str, max_tokens: int, temperature: float) -> Iterator[str]:
        """Stream a completion's text."""
        return self._stream(prompt, SamplingParams(max_tokens=max_tokens, temperature=temperature))

    def chat(self, messages: list[dict[str, str]], max_tokens: Optional[int],
             temperature: float) -> Iterator[str]:
        """Stream a chat reply's text."""
        try:
            ids = self.engine.input_processor.chat_prompt_ids(messages)
        except ValueError as err:
            raise RuntimeError(f"{err}; use `pagedllm complete`") from None
        return self._stream({"prompt_token_ids": ids},
                            SamplingParams(max_tokens=max_tokens, temperature=temperature))
