"""The command line and logs as vLLM users expect them: flags and their help, `serve --model`,
vLLM's ignored options, request and throughput log lines, chat commands, LLM()'s log lines and
progress bar, and doctor's advice."""
from __future__ import annotations

import argparse
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pexpect

from conftest import API_KEY, MODEL, _free_port
from pagedllm.engine.arg_utils import DTYPE_CHOICES, IGNORED_VLLM_ARGS, EngineArgs
from pagedllm.entrypoints.chat_cli import _chat_command
from pagedllm.entrypoints.cli import HelpFormatter, build_parser
from pagedllm.entrypoints.serve import HONORED_VLLM_ARGS, engine_args

CLI = [sys.executable, "-m", "pagedllm.entrypoints.cli"]
# vLLM's periodic line, for a window in which output tokens were sent
THROUGHPUT_WITH_OUTPUT = (r"INFO .* Avg prompt throughput: \d+\.\d tokens/s, Avg generation "
                          r"throughput: (?!0\.0 )\d+\.\d tokens/s, Running: \d+ reqs, Waiting: "
                          r"\d+ reqs, KV cache usage: \d+\.\d%")


def _parsers(parser: argparse.ArgumentParser, name: str = "pagedllm"):
    """(name, parser) for the parser and every sub-command's parser below it."""
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _parsers(sub, f"{name} {sub_name}")


def test_every_flag_has_help_with_its_default():
    for name, parser in _parsers(build_parser()):
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._VersionAction,
                                   argparse._SubParsersAction)):
                continue
            where = f"{name} {action.option_strings or action.dest}"
            text = HelpFormatter("pagedllm")._get_help_string(action)
            assert action.help and action.help != argparse.SUPPRESS, where
            if action.nargs == 0 or action.required or text.startswith("ignored: "):
                continue  # a switch is off unless given; an ignored option has no effect
            assert "default" in text.lower(), where
            if "--dtype" in action.option_strings:
                assert tuple(action.choices) == DTYPE_CHOICES, where
            if "--device" in action.option_strings:
                assert all(d in action.help for d in ("auto", "cpu", "cuda", "rocm", "xpu", "mps"))


def test_serve_help_shows_defaults_and_choices():
    proc = subprocess.run(CLI + ["serve", "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())
    assert "--port PORT port to listen on (default: 8000)" in text
    assert "--dtype {auto,float32,bfloat16,float16,float,half}" in text
    assert "--pipeline-parallel-size PIPELINE_PARALLEL_SIZE, -pp PIPELINE_PARALLEL_SIZE split " \
           "the layers into this many stages, one process each (default: 1)" in text
    assert "--tensor-parallel-size TENSOR_PARALLEL_SIZE, -tp TENSOR_PARALLEL_SIZE ranks each " \
           "layer is split over, one process (or Ray actor) each; with -pp, in every stage " \
           "(default: 1)" in text


def test_serve_takes_the_model_positionally_or_as_a_flag():
    parser = build_parser()
    assert parser.parse_args(["serve", "some/model"]).model == "some/model"
    assert parser.parse_args(["serve", "--model", "some/model"]).model == "some/model"
    assert parser.parse_args(["serve"]).model is None  # the default model
    args = parser.parse_args(["serve", "--model", "some/model", "--model-source", "modelscope"])
    assert (args.model, args.model_source) == ("some/model", "modelscope")


def test_serve_accepts_every_option_llm_ignores_with_the_same_warning(caplog):
    parser = build_parser()
    samples = {int: "2", float: "4.0", str: "x"}
    for name, ignored in IGNORED_VLLM_ARGS.items():
        if name in HONORED_VLLM_ARGS:
            continue
        flag = "--" + name.replace("_", "-")
        argv = ["serve", MODEL, flag] + ([samples[ignored.type]] if ignored.type else [])
        args = parser.parse_args(argv)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="pagedllm"):
            engine_args(args)
            from_cli = [r.getMessage() for r in caplog.records]
            caplog.clear()
            EngineArgs.from_kwargs(MODEL, **{name: getattr(args, name)})
            from_llm = [r.getMessage() for r in caplog.records]
        assert from_cli == from_llm and len(from_cli) == 1, (flag, from_cli, from_llm)
        assert from_cli[0].startswith(f"{name}=") and ignored.why in from_cli[0]


def test_serve_logs_each_request_and_the_throughput_while_busy(tmp_path):
    """`serve --model` with vLLM flags it ignores: the warnings, the banner after the load, a
    line per finished request with the token counts of its usage, and the throughput line."""
    port = _free_port()
    log = tmp_path / "serve.log"  # read through its own file object: no offset shared
    with open(log, "w") as out:
        proc = subprocess.Popen(
            CLI + ["serve", "--model", MODEL, "--port", str(port), "--enforce-eager", "-tp", "1",
                   "--swap-space", "4"],
            stdout=out, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "PAGEDLLM_LOG_STATS_INTERVAL": "0.5"})
        try:
            _wait_healthy(proc, f"http://127.0.0.1:{port}")
            usage = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60, json={
                "prompt": "The capital of France is", "max_tokens": 8, "ignore_eos": True,
            }).json()["usage"]
            text = _wait_for(log, THROUGHPUT_WITH_OUTPUT, seconds=10)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    assert "enforce_eager=True is ignored: the engine always runs eagerly" in text
    assert "swap_space=4.0 is ignored: preempted requests are recomputed" in text
    assert "tensor_parallel_size" not in text  # -tp 1 is an option in its own right now
    assert text.index("kernels: ") < text.index(f"pagedllm serving {MODEL!r} at "
                                                f"http://127.0.0.1:{port}/v1")
    assert (f": {usage['prompt_tokens']} prompt tokens, 8 output tokens in " in text
            and "Finished request cmpl-" in text), text[-3000:]
    assert re.search(THROUGHPUT_WITH_OUTPUT, text), text[-3000:]  # the window the tokens fell in


def _wait_healthy(proc: subprocess.Popen, url: str, seconds: float = 180) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the server exited"
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.5)
    raise AssertionError("the server did not become healthy")


def _wait_for(log: Path, pattern: str, seconds: float) -> str:
    """The log's text once it matches `pattern` (or after `seconds`)."""
    deadline = time.monotonic() + seconds
    while True:
        text = log.read_text()
        if re.search(pattern, text) or time.monotonic() > deadline:
            return text
        time.sleep(0.2)


def test_chat_commands_are_answered_locally(server):
    before = server.metrics()["vllm:prompt_tokens_total"]
    child = pexpect.spawn(CLI[0], CLI[1:] + ["chat", "--url", server.url, "--api-key", API_KEY],
                          encoding="utf-8", timeout=60)
    try:
        child.expect("/help lists commands")
        child.expect("\n> ")
        child.sendline("/help")
        child.expect("/clear  forget the conversation")
        child.expect("\n> ")
        child.sendline("/clear")
        child.expect(r"\(conversation cleared\)")
        child.sendline("/nonsense")
        child.expect("unknown command /nonsense; /help lists the commands")
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0
    assert server.metrics()["vllm:prompt_tokens_total"] == before  # nothing reached the model


def test_clear_keeps_the_system_prompt():
    history = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
               {"role": "assistant", "content": "hello"}]
    _chat_command("/clear", history)
    assert history == [{"role": "system", "content": "be brief"}]
    history = [{"role": "user", "content": "hi"}]
    _chat_command("/clear", history)
    assert history == []


LLM_JOB = """
from pagedllm import LLM, SamplingParams
llm = LLM(%r)
# the first request ends ~0.2 s in: tqdm draws at most every 0.1 s, so a request that ends in
# the first step would not show as 1/3
params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0) for n in (20, 50, 90)]
outs = llm.generate(["a", "b", "c"], params)
print(sum(len(o.outputs[0].token_ids) for o in outs))
"""


def test_llm_logs_its_choices_and_its_progress_bar_counts_requests():
    proc = subprocess.run([sys.executable, "-c", LLM_JOB % MODEL], capture_output=True,
                          text=True, timeout=300,
                          env={k: v for k, v in os.environ.items()
                               if k not in ("PAGEDLLM_LOGGING_LEVEL", "VLLM_LOGGING_LEVEL")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["160"]
    lines = proc.stderr.splitlines()
    for what in ("device cpu", "dtype float32: quantization gguf", "kernels: ", "memory plan: "):
        assert [line for line in lines if line.startswith("INFO ") and what in line], what
    states = proc.stderr.split("\r")  # tqdm redraws the bar in place
    assert any("1/3" in s for s in states) and any("2/3" in s for s in states), states
    final = [s for s in states if "3/3" in s][-1]
    assert "est. speed input: " in final and "output: " in final and "toks/s" in final


def test_logging_level_from_the_environment(huge_model):
    job = (f"from pagedllm import LLM\ntry:\n    LLM({str(huge_model)!r})\n"
           "except ValueError:\n    pass")
    levels = {}
    for level in ("", "WARNING"):
        env = {**os.environ, "PAGEDLLM_LOGGING_LEVEL": level}
        levels[level] = subprocess.run([sys.executable, "-c", job], capture_output=True,
                                       text=True, timeout=120, env=env).stderr
    assert "INFO " in levels[""] and "device cpu" in levels[""]
    assert "INFO " not in levels["WARNING"]


def test_doctor_names_a_model_that_works_offline_before_one_from_the_hub(huge_model,
                                                                        smollm_gguf):
    proc = subprocess.run(CLI + ["doctor", str(huge_model)], capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 1, proc.stderr[-3000:]  # 1: does not fit
    offline = proc.stdout.index("a model already on this machine (no download): ")
    assert offline < proc.stdout.index("a smaller model of the same family: Qwen2.5-")
