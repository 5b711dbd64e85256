"""`pagedllm bench latency|throughput|serve`, like `vllm bench`: a table on stdout, JSON on request.

`serve` measures any OpenAI-compatible server (pagedllm, vLLM, llama.cpp's llama-server), so
the same client compares them side by side.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import platform
import random
import resource
import statistics
import time
from typing import Any, Optional

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.hub.model_store import DEFAULT_MODEL


def _int_at_least(minimum: int):
    """An argparse type: an integer of at least `minimum`."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(
                f"must be an integer of at least {minimum}, got {text!r}")
        return value
    return parse


_positive = _int_at_least(1)
_non_negative = _int_at_least(0)


def _range_ratio(text: str) -> float:
    """--random-range-ratio: a float in [0, 1), as vLLM's bench takes it."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1), got {text!r}") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {value}")
    return value


def _float_in(lo: float, hi: float, lo_open: bool = False):
    """A float in [lo, hi] ((lo, hi] with lo_open) for --temperature / --top-p."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
        if not lo <= value <= hi or (lo_open and value == lo):
            raise argparse.ArgumentTypeError(
                f"must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {value}")
        return value
    return parse


def _lengths(n: int, length: int, ratio: float, seed: int) -> list[int]:
    """n lengths drawn uniformly from [length (1 - ratio), length (1 + ratio)] (all `length`
    at ratio 0), at least 1, the same for every run with this seed."""
    lo, hi = max(1, round(length * (1 - ratio))), max(1, round(length * (1 + ratio)))
    rng = random.Random(seed)
    return [rng.randint(lo, hi) for _ in range(n)]


_ASSIGNMENTS = ("random", "round-robin")  # vLLM's --lora-assignment


def add_bench_parser(sub) -> None:
    """`bench` with its three modes."""
    bench = sub.add_parser("bench", help="measure latency, offline throughput, or a server")
    modes = bench.add_subparsers(dest="mode", required=True)
    for name, text in (("latency", "one stream: time to first token, prefill and decode tok/s"),
                       ("throughput", "N prompts offline: output and total tok/s (a pooling "
                                      "model: inputs pooled per second)"),
                       ("serve", "an OpenAI-compatible server under concurrency")):
        p = modes.add_parser(name, help=text, description=text)
        p.add_argument("--model", default=None if name == "serve" else DEFAULT_MODEL,
                       help="the model to load" if name != "serve" else
                       "the model to ask for (default: the server's first model)")
        p.add_argument("--input-len", type=_positive, default=100, help="prompt tokens")
        p.add_argument("--output-len", type=_positive, default=128, help="output tokens")
        p.add_argument("--num-prompts", type=_positive, default=1 if name == "latency" else 32,
                       help="requests")
        p.add_argument("--output-json", default=None, metavar="PATH",
                       help="also write the results as JSON here (default: stdout only)")
        # vLLM's `bench serve` names; the requests still run to --output-len (ignore_eos)
        p.add_argument("--temperature", type=_float_in(0.0, float("inf")), default=0.0,
                       help="sampling temperature of every request (default 0: greedy)")
        p.add_argument("--top-p", type=_float_in(0.0, 1.0, lo_open=True), default=1.0,
                       help="nucleus sampling's p (default 1: off)")
        p.add_argument("--top-k", type=_int_at_least(-1), default=-1,
                       help="keep the k most likely tokens (default -1: off)")
        if name == "throughput":
            p.add_argument("--num-warmups", type=_non_negative, default=0,
                           help="vLLM's: prompts like the timed ones (other token ids, so no "
                                "prefix is cached for the timed run) run first and not timed")
            p.add_argument("--random-range-ratio", type=_range_ratio, default=0.0,
                           help="vLLM's random dataset: each request's prompt (and output) "
                                "length drawn uniformly from [L (1 - r), L (1 + r)] around "
                                "--input-len (--output-len), seeded; 0: all alike")
            p.add_argument("--lora-modules", action="extend", nargs="+", default=None,
                           metavar="NAME=PATH", help="LoRA adapters the requests are spread "
                           "over, round-robin (name=path, or JSON as `serve` takes it; implies "
                           "--enable-lora; give --max-loras for them to share a batch; default: none, "
                           "every request on the base model)")
            p.add_argument("--lora-path", default=None, metavar="PATH",
                           help="vLLM's: one adapter (a PEFT directory or a llama.cpp GGUF LoRA "
                                "file) under --max-loras ids, named '1' to 'N', spread over the "
                                "requests by --lora-assignment (implies --enable-lora; default: none)")
            p.add_argument("--lora-assignment", choices=_ASSIGNMENTS, default=None,
                           help="how each request picks its adapter: random (seeded; "
                                "--lora-path's default, as in vLLM) or round-robin "
                                "(--lora-modules' default)")
        if name == "latency":
            p.add_argument("--workload", choices=WORKLOADS, default="random",
                           help="random: --input-len made-up token ids; code-edit: a 200-400 "
                                "line source file of pagedllm's and 'rename X to Y' as a chat "
                                "(the answer repeats the file: what n-gram speculation "
                                "predicts); chat: a different open question each request (no "
                                "repetition); --input-len applies to random only")
            p.add_argument("--num-iters", type=_positive, default=3,
                           help="requests timed, one after another (the mean is reported)")
            p.add_argument("--num-iters-warmup", type=_non_negative, default=1,
                           help="requests run first and not timed")
        if name == "serve":
            p.add_argument("--url", required=True,
                           help="the server to measure, e.g. http://127.0.0.1:8000/v1")
            p.add_argument("--max-concurrency", type=_positive, default=16,
                           help="requests in flight at once")
            p.add_argument("--api-key", default=None, help="the server's key (default: no key)")
        else:
            EngineArgs.add_cli_args(p, title="engine", with_ignored=True)
            p.add_argument("--structured-output", choices=("none", "json"), default="none",
                           help="json: every request constrained to a JSON array of at least "
                                "--output-len integers (so it runs to --output-len tokens)")


def machine() -> dict[str, Any]:
    """Where the numbers were taken."""
    from pagedllm.platforms import cpu_platform

    info = cpu_platform().info
    return {"cpu": info.model_name, "isa": list(info.features), "threads": info.threads,
            "python": platform.python_version(), "os": platform.platform()}


def _token_prompts(tokenizer, n: int, length: int, ratio: float = 0.0) -> list[dict]:
    vocab = tokenizer.vocab_size
    return [{"prompt_token_ids": [(1000 + 37 * i + 13 * j) % vocab for j in range(lens)]}
            for i, lens in enumerate(_lengths(n, length, ratio, seed=0))]


WORKLOADS = ("random", "code-edit", "chat")
_CHAT_QUESTIONS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator works to a ten-year-old.",
    "Describe the history of the printing press and its effect on Europe.",
    "What should a beginner know before planting a vegetable garden?",
    "Compare the climates of Norway and Morocco.",
    "Invent a board game for four players and explain its rules.",
    "Why do cats purr? Give the main theories.",
    "Plan a three-day trip to Kyoto for someone who loves food.",
)


def _source_files(n: int) -> list:
    """n of pagedllm's own source files of 200-400 lines (the same ones every run)."""
    from pathlib import Path

    package = Path(__file__).resolve().parents[1]  # pagedllm/
    files = [p for p in sorted(package.rglob("*.py"))
             if 200 <= len(p.read_text().splitlines()) <= 400]
    if len(files) < n:
        raise SystemExit(f"--workload code-edit has {len(files)} source files for {n} requests")
    return files[:n]


def _rename_prompt(text: str) -> str:
    """The file and an instruction to rename its most frequent long identifier."""
    import collections
    import keyword
    import re

    words = collections.Counter(w for w in re.findall(r"\b[a-z_][a-z0-9_]{5,}\b", text)
                                if not keyword.iskeyword(w))
    name = words.most_common(1)[0][0]
    return (f"```python\n{text}```\n\nRename `{name}` to `{name}_v2` everywhere in this file. "
            "Answer with the whole updated file only.")


def workload_prompts(tokenizer, workload: str, n: int, input_len: int) -> list[dict]:
    """n prompts of the workload as token ids (each different: none finds another's prefix
    cached); tokenizer: the engine's (pagedllm's FastTokenizer)."""
    if workload == "random":
        return _token_prompts(tokenizer, n, input_len)
    if workload == "code-edit":
        texts = [_rename_prompt(p.read_text()) for p in _source_files(n)]
    else:
        texts = [_CHAT_QUESTIONS[i % len(_CHAT_QUESTIONS)] + ("" if i < len(_CHAT_QUESTIONS)
                 else f" (take {i // len(_CHAT_QUESTIONS) + 1})") for i in range(n)]
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                           add_generation_prompt=True) for t in texts]
    return [{"prompt_token_ids": list(tokenizer.encode(c, add_special_tokens=False))}
            for c in chats]


def _spec_report(llm) -> dict[str, Any]:
    """Speculative decoding's counts over the timed requests (none when it is off)."""
    stats = llm.llm_engine.spec_stats()
    if stats is None:
        return {}
    return {"spec_num_drafts": stats.num_drafts, "spec_num_draft_tokens": stats.num_draft_tokens,
            "spec_num_accepted_tokens": stats.num_accepted_tokens,
            "spec_acceptance_rate": stats.acceptance_rate or 0.0,
            "spec_mean_acceptance_length": 1 + stats.num_accepted_tokens / max(1, stats.num_drafts),
            # what one more verify row costs against a plain step, as the speculator fitted it
            "spec_row_cost": llm.llm_engine.engine_core.scheduler.speculator.cost.row_cost}


def _timed_request(engine, request_id: str, prompt: dict, params) -> tuple[float, float]:
    """(time to the first token, time to the last) of one request stepped alone."""
    start = time.perf_counter()
    first = None
    engine.add_request(request_id, prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if first is None and out.outputs[0].token_ids:
                first = time.perf_counter()
    return first - start, time.perf_counter() - start


def _params(args: argparse.Namespace):
    """ignore_eos, --output-len tokens, greedy unless --temperature / --top-p / --top-k say
    otherwise; constrained with --structured-output json."""
    from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams

    constraint = None
    if args.structured_output == "json":
        # the array cannot close before --output-len items, so the grammar never ends a
        # request before max_tokens: constrained and free requests generate the same counts
        schema = {"type": "array", "items": {"type": "integer"}, "minItems": args.output_len}
        constraint = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    return SamplingParams(max_tokens=args.output_len, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, ignore_eos=True,
                          structured_outputs=constraint)


def _llm(args: argparse.Namespace):
    """The LLM the offline modes measure (a bad engine flag is refused before torch loads)."""
    if getattr(args, "lora_modules", None) or getattr(args, "lora_path", None):
        args.enable_lora = True
    engine_args = EngineArgs.from_cli_args(args, args.model)
    from pagedllm.llm import LLM

    return LLM(**dataclasses.asdict(engine_args))


def _comm_stats(llm, reset: bool = False) -> Optional[list[dict]]:
    """Each rank's send/recv and collective counters (worker/stage_comm.py,
    distributed/comm_stats.py), or None in one process."""
    return llm.llm_engine.rank_comm_stats(reset)


def _pp_report(stats: list[dict]) -> dict[str, Any]:
    """Per step: the first rank's send (the transfer: the next stage is waiting in its
    receive) and each later rank's receive (the transfer plus the wait for the stages before
    it to compute), in milliseconds; the bytes a step moves."""
    steps = max(1, stats[0]["sends"])
    out: dict[str, Any] = {"pp_steps": stats[0]["sends"],
                           "pp_bytes_per_step": stats[0]["send_bytes"] / steps}
    for rank, s in enumerate(stats):
        if s["sends"]:
            out[f"pp_rank{rank}_send_ms_per_step"] = 1e3 * s["send_s"] / s["sends"]
        if s["recvs"]:
            out[f"pp_rank{rank}_recv_ms_per_step"] = 1e3 * s["recv_s"] / s["recvs"]
    return out


def _tp_report(stats: list[dict]) -> dict[str, Any]:
    """Per step, on each rank: the all-reduces' (two a layer and the embedding's) and the
    logits' all-gather's milliseconds, each the transfer plus the wait for the slowest rank
    (tp_allreduce_ms_per_step: the least of the ranks'); the all-reduces a step and the bytes
    each rank gives them."""
    first = stats[0]
    steps = max(1, first["forwards"])
    out: dict[str, Any] = {"tp_steps": first["forwards"],
                           "tp_allreduces_per_step": first["all_reduces"] / steps,
                           "tp_allreduce_bytes_per_step": first["all_reduce_bytes"] / steps}
    for rank, s in enumerate(stats):
        out[f"tp_rank{rank}_allreduce_ms_per_step"] = 1e3 * s["all_reduce_s"] / steps
        out[f"tp_rank{rank}_allgather_ms_per_step"] = 1e3 * s["all_gather_s"] / steps
    # the rank that waited least for the others: nearest the transfer alone
    out["tp_allreduce_ms_per_step"] = min(out[f"tp_rank{r}_allreduce_ms_per_step"]
                                          for r in range(len(stats)))
    return out


def _comm_report(stats: Optional[list[dict]]) -> dict[str, Any]:
    """The tensor-parallel collectives (tp_*) and the pipeline's send/recv (pp_*) per step,
    whichever the ranks ran (both under -tp N -pp M; ranks by their global number)."""
    if not stats:
        return {}
    out: dict[str, Any] = {}
    if stats[0].get("forwards"):
        out.update(_tp_report(stats))
    if stats[0].get("sends"):
        out.update(_pp_report(stats))
    return out


def run_latency(args: argparse.Namespace) -> dict[str, Any]:
    """One stream, in-process: the mean of --num-iters requests after --num-iters-warmup."""
    llm = _llm(args)
    params = _params(args)
    # a different prompt each time, so that none finds another's prefix cached
    prompts = workload_prompts(llm.llm_engine.tokenizer, args.workload, args.num_iters_warmup + args.num_iters,
                                args.input_len)
    times = []
    for i, prompt in enumerate(prompts):
        if i == args.num_iters_warmup:
            _comm_stats(llm, reset=True)
            _reset_spec_stats(llm)
        times.append(_timed_request(llm.llm_engine, f"latency-{i}", prompt, params))
    times = times[args.num_iters_warmup:]
    ttft = statistics.mean(first for first, _ in times)
    input_len = statistics.mean(len(p["prompt_token_ids"]) for p in
                                prompts[args.num_iters_warmup:])
    result = {"workload": args.workload, "num_iters": args.num_iters, "ttft_s": ttft,
              "mean_input_len": input_len, "prefill_tok_per_s": input_len / ttft,
              "request_latency_s": statistics.mean(total for _, total in times)}
    if args.output_len > 1:
        decode_s = statistics.mean(total - first for first, total in times)
        result["decode_tok_per_s"] = (args.output_len - 1) / decode_s
        result["decode_ms_per_step"] = 1e3 * decode_s / (args.output_len - 1)
    return {**result, **_spec_report(llm), **_comm_report(_comm_stats(llm))}


def _reset_spec_stats(llm) -> None:
    """Count speculation over the timed requests only."""
    speculator = llm.llm_engine.engine_core.scheduler.speculator
    if speculator is not None:
        speculator.reset_stats()


def _pool_throughput(llm, prompts: list[dict], warmups: list[dict]) -> dict[str, Any]:
    """A pooling model's workload: N inputs of --input-len tokens through LLM.encode (each
    pooled once; nothing is generated, --output-len does not apply)."""
    llm.encode(warmups or prompts[:1], use_tqdm=False)  # untimed: the first step's one-time costs
    t = time.perf_counter()
    outs = llm.encode(prompts, use_tqdm=False)
    elapsed = time.perf_counter() - t
    tokens = sum(len(o.prompt_token_ids) for o in outs)
    return {"task": "pooling", "elapsed_s": elapsed, "requests_per_s": len(outs) / elapsed,
            "input_tokens": tokens, "input_tok_per_s": tokens / elapsed,
            "vector_size": int(outs[0].outputs.data.numel())}


def _adapters(args: argparse.Namespace) -> list:
    """--lora-modules' adapters, or --lora-path's one adapter under ids 1 to --max-loras (as
    vLLM's bench throughput names them: "1" to "N"); a bad value exits naming it."""
    from pagedllm.entrypoints.openai.lora_modules import lora_modules
    from pagedllm.lora.request import LoRARequest

    if args.lora_path and args.lora_modules:
        raise SystemExit("--lora-path and --lora-modules both name adapters: give one of them")
    if args.lora_path:
        max_loras = args.max_loras or 1
        return [LoRARequest(str(i), i, args.lora_path) for i in range(1, max_loras + 1)]
    try:
        return list(lora_modules(args.lora_modules, True, args.model).values())
    except ValueError as err:
        raise SystemExit(str(err)) from None


def _spread_loras(args: argparse.Namespace) -> Optional[list]:
    """One adapter per request (None: every request on the base model), by --lora-assignment:
    round-robin, or random (seeded: the same spread every run); a bad value exits naming it,
    before the model loads."""
    if not (args.lora_modules or args.lora_path):
        if args.lora_assignment is not None:
            raise SystemExit("--lora-assignment spreads --lora-path's or --lora-modules' "
                             "adapters: give one of them")
        return None
    adapters = _adapters(args)
    assignment = args.lora_assignment or ("random" if args.lora_path else "round-robin")
    if assignment == "round-robin":
        return [adapters[i % len(adapters)] for i in range(args.num_prompts)]
    pick = random.Random(0)
    return [pick.choice(adapters) for _ in range(args.num_prompts)]


def run_throughput(args: argparse.Namespace) -> dict[str, Any]:
    """N prompts through LLM.generate (a pooling model's through LLM.encode), spread over
    --lora-modules' adapters if given."""
    loras = _spread_loras(args)
    llm = _llm(args)
    # the warm-up's prompts after the timed ones': the same lengths' draw, other first tokens
    every = _token_prompts(llm.llm_engine.tokenizer, args.num_prompts + args.num_warmups,
                           args.input_len, args.random_range_ratio)
    prompts, warmups = every[:args.num_prompts], every[args.num_prompts:]
    if llm.llm_engine.config.is_pooling:
        if args.structured_output != "none":
            raise SystemExit("--structured-output applies to generation; this model pools")
        return _pool_throughput(llm, prompts, warmups)
    params = _params(args)
    for adapter in set(loras or ()):  # a bad adapter exits naming its tensor, before timing
        try:
            llm.llm_engine.adapters.check(adapter)
        except ValueError as err:
            raise SystemExit(str(err)) from None
    if args.random_range_ratio:  # each request its own output length, as its prompt's
        if params.structured_outputs is not None:
            raise SystemExit("--random-range-ratio varies --output-len, which "
                             "--structured-output json's arrays are sized by: use one of them")
        params = [dataclasses.replace(params, max_tokens=n) for n in _lengths(
            len(prompts), args.output_len, args.random_range_ratio, seed=1)]
    warmup_tokens = 0
    if warmups:  # untimed, as vLLM's --num-warmups: on the base model, --output-len tokens each
        warmup_tokens = sum(len(o.outputs[0].token_ids)
                            for o in llm.generate(warmups, _params(args), use_tqdm=False))
    if not warmups and not isinstance(params, list) and params.structured_outputs is not None:
        # once per engine, untimed (the warm-up, where asked, did it): the grammar engine's view
        # of the vocabulary (~1 s for 152k tokens) and this schema's compilation
        llm.generate(prompts[:1], _params(args).clone(), use_tqdm=False)
    _comm_stats(llm, reset=True)
    before = resource.getrusage(resource.RUSAGE_SELF)
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    elapsed = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_SELF)
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    # time in the kernel (page faults, zeroing fresh pages) shows what the allocator costs
    return {"elapsed_s": elapsed, "output_tokens": out_tokens,
            "warmup_output_tokens": warmup_tokens,
            "output_tok_per_s": out_tokens / elapsed,
            "total_tok_per_s": (out_tokens + sum(len(p["prompt_token_ids"]) for p in prompts))
            / elapsed,
            "system_cpu_s": after.ru_stime - before.ru_stime,
            "minor_page_faults": after.ru_minflt - before.ru_minflt,
            # pipeline stages: how many batches were in flight at once (1: one step at a time)
            "max_batches_in_flight": llm.llm_engine.max_batches_in_flight,
            **({} if loras is None else {"lora_adapters": len(set(loras)),
                                         "max_loras": llm.llm_engine.config.lora.max_loras}),
            **_comm_report(_comm_stats(llm))}


class _NothingReceived(Exception):
    """The connection failed before the server's answer began (a keep-alive connection the
    server had closed, say): the request can be sent again on a fresh connection."""


async def _one_request(client, url: str, headers: dict, body: dict) -> dict[str, Any]:
    """One streamed completion's timings; _NothingReceived if no answer began."""
    import httpx

    start = time.perf_counter()
    request = client.build_request("POST", url, json=body, headers=headers)
    try:
        resp = await client.send(request, stream=True)
    except httpx.TransportError as err:
        raise _NothingReceived(f"{type(err).__name__}: {err}") from err
    try:
        return await _timings(resp, start)
    finally:
        await resp.aclose()


async def _timings(resp, start: float) -> dict[str, Any]:
    """Time to first token, inter-token gaps and tokens of a streamed answer."""
    ttft, stamps, out_tokens = None, [], 0
    if resp.status_code != 200:
        await resp.aread()
        raise RuntimeError(f"server answered {resp.status_code}: {resp.text[:300]}")
    async for line in resp.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        data = json.loads(line[6:])
        if data.get("usage"):
            out_tokens = data["usage"].get("completion_tokens", out_tokens)
        if any(c.get("text") for c in data.get("choices", [])):
            now = time.perf_counter()
            ttft = ttft if ttft is not None else now - start
            stamps.append(now)
    itl = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"ttft": ttft or 0.0, "latency": time.perf_counter() - start, "itl": itl,
            "output_tokens": out_tokens or len(stamps)}


async def _serve(args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    base = args.url.rstrip("/")
    base = base if base.endswith("/v1") else base + "/v1"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(timeout=None) as client:
        try:
            model = args.model or (await client.get(f"{base}/models", headers=headers)).json()[
                "data"][0]["id"]
        except httpx.TransportError as err:
            raise ConnectionError(f"cannot reach {base}: {err}") from None
        sem = asyncio.Semaphore(args.max_concurrency)
        retried: list[int] = []  # requests sent again after a connection closed unanswered

        async def limited(i: int) -> dict[str, Any]:
            body = {"model": model, "prompt": " ".join(f"word{i}" if j == 0 else "hello"
                                                       for j in range(args.input_len)),
                    "max_tokens": args.output_len, "temperature": args.temperature,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            if args.top_p < 1.0:
                body["top_p"] = args.top_p
            if args.top_k > 0:
                body["top_k"] = args.top_k
            async with sem:
                try:
                    try:
                        return await _one_request(client, f"{base}/completions", headers, body)
                    except _NothingReceived:
                        # a server may close idle keep-alive connections (llama-server does):
                        # send it once more on a connection of its own, and count it
                        retried.append(i)
                        async with httpx.AsyncClient(timeout=None) as fresh:
                            return await _one_request(fresh, f"{base}/completions", headers, body)
                except (httpx.TransportError, _NothingReceived) as err:
                    raise ConnectionError(f"lost {base} during the run: {err}") from None

        t = time.perf_counter()
        results = await asyncio.gather(*(limited(i) for i in range(args.num_prompts)))
        elapsed = time.perf_counter() - t
    ttfts = sorted(r["ttft"] for r in results)
    itls = sorted(x for r in results for x in r["itl"]) or [0.0]
    lat = sorted(r["latency"] for r in results)
    out_tokens = sum(r["output_tokens"] for r in results)
    return {"model": model, "elapsed_s": elapsed, "output_tokens": out_tokens,
            "output_tok_per_s": out_tokens / elapsed, "ttft_mean_s": statistics.mean(ttfts),
            "ttft_p50_s": _pct(ttfts, 50), "ttft_p99_s": _pct(ttfts, 99),
            "itl_p50_s": _pct(itls, 50), "itl_p99_s": _pct(itls, 99),
            "request_latency_p50_s": _pct(lat, 50), "request_latency_p99_s": _pct(lat, 99),
            "retried_requests": len(retried)}


def _pct(sorted_values: list[float], p: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(round(p / 100 * (len(sorted_values) - 1))))]


def run_bench(args: argparse.Namespace) -> int:
    """Run one mode, print a table, write JSON if asked."""
    if args.mode == "latency":
        result = run_latency(args)
    elif args.mode == "throughput":
        result = run_throughput(args)
    else:
        result = asyncio.run(_serve(args))
    result = {"mode": args.mode, "input_len": args.input_len, "output_len": args.output_len,
              "num_prompts": args.num_prompts,
              "sampling": ("greedy" if args.temperature == 0.0 or args.top_k == 1
                           else f"temperature {args.temperature:g}, top_p {args.top_p:g}, "
                                f"top_k {args.top_k}"), **result,
              "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
              "machine": machine()}
    if getattr(args, "model", None) and "model" not in result:
        result["model"] = args.model
    width = max(len(k) for k in result)
    for key, value in result.items():
        if key != "machine":
            shown = f"{value:.3f}" if isinstance(value, float) else value
            print(f"{key:<{width}}  {shown}")
    if args.output_json:
        with open(args.output_json, "w") as fh:
            json.dump(result, fh, indent=2)
    return 0


__all__ = ["add_bench_parser", "run_bench"]
