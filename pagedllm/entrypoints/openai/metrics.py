"""GET /metrics: Prometheus text with vLLM's metric names."""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from pagedllm.engine.async_engine import AsyncLLM

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


class ServerMetrics:
    """Request gauges read from the engine at scrape time; token counters and latency histograms
    fed by AsyncLLM as outputs reach the clients."""

    def __init__(self, engine: AsyncLLM, model_name: str) -> None:
        self.engine = engine
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}

        def gauge(name: str, doc: str, fn) -> None:
            g = Gauge(name, doc, list(labels), registry=self.registry)
            g.labels(**labels).set_function(fn)

        gauge("vllm:num_requests_running", "Sequences being computed.",
              lambda: engine.stats().num_running)
        gauge("vllm:num_requests_waiting", "Sequences waiting or preempted.",
              lambda: engine.stats().num_waiting)
        gauge("vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).",
              lambda: engine.stats().kv_cache_usage)
        self._prompt = Counter("vllm:prompt_tokens", "Prompt tokens processed.", list(labels),
                               registry=self.registry).labels(**labels)
        self._gen = Counter("vllm:generation_tokens", "Tokens generated.", list(labels),
                            registry=self.registry).labels(**labels)
        self._ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.",
                               list(labels), buckets=_LATENCY_BUCKETS,
                               registry=self.registry).labels(**labels)
        self._itl = Histogram("vllm:inter_token_latency_seconds", "Time between output tokens.",
                              list(labels), buckets=_LATENCY_BUCKETS,
                              registry=self.registry).labels(**labels)
        self._e2e = Histogram("vllm:e2e_request_latency_seconds", "Time from arrival to the "
                              "last output.", list(labels), buckets=_LATENCY_BUCKETS,
                              registry=self.registry).labels(**labels)
        if engine.engine.config.speculative is not None:
            self.registry.register(_SpecDecodeCollector(engine, model_name))
        lora = engine.engine.config.lora
        self._max_lora = None if lora is None else str(lora.max_loras)
        # vLLM's: one series, its labels the adapters in use, its value when it was read
        self._lora_info = None if lora is None else Gauge(
            "vllm:lora_requests_info", "Running stats on LoRA requests.",
            ["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
            registry=self.registry)

    def first_token(self, prompt_tokens: int, num_tokens: int, seconds: float) -> None:
        """A request's first output tokens reached its client, `seconds` after it arrived."""
        self._ttft.observe(seconds)

    def next_tokens(self, num_tokens: int, seconds: float) -> None:
        """num_tokens more tokens arrived, seconds after the previous ones."""
        for _ in range(num_tokens):
            self._itl.observe(seconds / num_tokens)

    def finished(self, request_id: str, prompt_tokens: int, generation_tokens: int,
                 seconds: float) -> None:
        """A request ended, `seconds` after it arrived."""
        self._prompt.inc(prompt_tokens)
        self._gen.inc(generation_tokens)
        self._e2e.observe(seconds)

    def render(self) -> bytes:
        """The Prometheus text page."""
        if self._lora_info is not None:
            stats = self.engine.stats()
            self._lora_info.clear()
            self._lora_info.labels(",".join(stats.running_loras), ",".join(stats.waiting_loras),
                                   self._max_lora).set(time.time())
        return generate_latest(self.registry)


class _SpecDecodeCollector:
    """vLLM's vllm:spec_decode_* counters, read from the engine's counts at scrape time."""

    def __init__(self, engine: AsyncLLM, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self):
        """The four counters (per position: one sample per draft position)."""
        stats = self.engine.stats().spec
        if stats is None:
            return
        for name, doc, value in (
                ("num_drafts", "Number of spec decoding drafts.", stats.num_drafts),
                ("num_draft_tokens", "Number of draft tokens.", stats.num_draft_tokens),
                ("num_accepted_tokens", "Number of accepted tokens.",
                 stats.num_accepted_tokens)):
            family = CounterMetricFamily(f"vllm:spec_decode_{name}", doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
        family = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                     "Accepted tokens per draft position.",
                                     labels=["model_name", "position"])
        for pos, value in enumerate(stats.accepted_per_pos):
            family.add_metric([self.model_name, str(pos)], value)
        yield family
