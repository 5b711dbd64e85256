"""`pagedllm bench`: latency and throughput in-process, serve against a real server; JSON keys."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from conftest import API_KEY, MODEL

CLI = [sys.executable, "-m", "pagedllm.entrypoints.cli", "bench"]


def _run(args: list[str], out) -> dict:
    proc = subprocess.run(CLI + args + ["--output-json", str(out)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    for key, value in result.items():  # the table shows every number
        if key != "machine":
            assert key in proc.stdout
    assert result["machine"]["threads"] >= 1 and result["peak_rss_bytes"] > 0
    return result


@pytest.mark.parametrize("mode,keys", [
    ("latency", ("ttft_s", "prefill_tok_per_s", "decode_tok_per_s")),
    ("throughput", ("output_tok_per_s", "total_tok_per_s")),
])
def test_offline_modes(mode, keys, tmp_path, smollm_gguf):
    result = _run([mode, "--model", MODEL, "--dtype", "float32", "--input-len", "16",
                   "--output-len", "8", "--num-prompts", "4"], tmp_path / "r.json")
    assert all(result[k] > 0 for k in keys) and result["sampling"] == "greedy"
    if mode == "throughput":
        assert result["output_tokens"] == 4 * 8
        assert result["system_cpu_s"] >= 0 and result["minor_page_faults"] >= 0
    else:  # first and last token of each request: decode time is what follows the first token
        assert result["num_iters"] == 3  # the default, after one warm-up request
        decode_s = 7 / result["decode_tok_per_s"]
        assert result["ttft_s"] + decode_s == pytest.approx(result["request_latency_s"])


def test_throughput_warms_up_untimed_on_other_prompts(tmp_path, smollm_gguf):
    """vLLM's --num-warmups: requests of the timed shape run first, untimed; their prompts are
    not the timed ones' (no cached prefix), which stay as without a warm-up."""
    from pagedllm.entrypoints.bench import _token_prompts

    class Tok:
        vocab_size = 49152

    timed, more = _token_prompts(Tok, 4, 16), _token_prompts(Tok, 6, 16)
    assert more[:4] == timed and len({p["prompt_token_ids"][0] for p in more}) == 6
    result = _run(["throughput", "--model", MODEL, "--dtype", "float32", "--input-len", "16",
                   "--output-len", "8", "--num-prompts", "4", "--num-warmups", "2"],
                  tmp_path / "r.json")
    assert result["warmup_output_tokens"] == 2 * 8 and result["output_tokens"] == 4 * 8
    assert result["total_tok_per_s"] * result["elapsed_s"] == pytest.approx(4 * (16 + 8))
    proc = subprocess.run(CLI + ["throughput", "--num-warmups", "-1"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "--num-warmups" in proc.stderr


def test_speculation_on_the_code_edit_workload(tmp_path, smollm_gguf):
    """The code-edit workload's answer repeats its prompt: n-gram drafts are kept, and the
    acceptance is reported."""
    result = _run(["latency", "--model", MODEL, "--workload", "code-edit", "--output-len", "64",
                   "--num-iters", "1", "--num-iters-warmup", "0", "--speculative-config",
                   '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, '
                   '"prompt_lookup_max": 4}'], tmp_path / "r.json")
    assert result["workload"] == "code-edit" and result["mean_input_len"] > 1000
    assert result["spec_num_drafts"] > 0 and 0 < result["spec_acceptance_rate"] <= 1
    assert result["spec_mean_acceptance_length"] > 1
    assert 0.01 <= result["spec_row_cost"] <= 4.0


def test_throughput_of_a_pooling_model(tmp_path, minilm_dir):
    result = _run(["throughput", "--model", str(minilm_dir), "--dtype", "float32",
                   "--input-len", "32", "--num-prompts", "16"], tmp_path / "r.json")
    assert result["task"] == "pooling" and result["input_tokens"] == 16 * 32
    assert result["requests_per_s"] > 0 and result["input_tok_per_s"] > 0
    assert result["vector_size"] == 384


def test_random_range_ratio_varies_each_request(tmp_path, minilm_dir, smollm_gguf):
    """vLLM's random dataset: prompt lengths (and output lengths) drawn from [L/2, 3L/2] at
    ratio 0.5, the same draw every run; a ratio outside [0, 1) is refused by name."""
    from pagedllm.entrypoints.bench import _lengths

    lens = _lengths(1000, 40, 0.5, seed=0)
    assert min(lens) == 20 and max(lens) == 60 and lens == _lengths(1000, 40, 0.5, seed=0)
    result = _run(["throughput", "--model", str(minilm_dir), "--dtype", "float32",
                   "--input-len", "40", "--random-range-ratio", "0.5", "--num-prompts", "16"],
                  tmp_path / "r.json")
    assert result["input_tokens"] == sum(_lengths(16, 40, 0.5, seed=0))
    result = _run(["throughput", "--model", MODEL, "--dtype", "float32", "--input-len", "8",
                   "--output-len", "8", "--random-range-ratio", "0.5", "--num-prompts", "4"],
                  tmp_path / "g.json")
    assert result["output_tokens"] == sum(_lengths(4, 8, 0.5, seed=1))
    proc = subprocess.run(CLI + ["throughput", "--random-range-ratio", "1"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "--random-range-ratio: must be in [0, 1), got 1.0" in proc.stderr


def test_latency_at_the_smallest_counts_reports_no_decode_rate(tmp_path, smollm_gguf):
    result = _run(["latency", "--model", MODEL, "--dtype", "float32", "--input-len", "1",
                   "--output-len", "1", "--num-iters", "1", "--num-iters-warmup", "0"],
                  tmp_path / "r.json")
    assert result["num_iters"] == 1 and result["ttft_s"] > 0
    assert "decode_tok_per_s" not in result  # one token: nothing after the first to time


def test_pipeline_parallel_reports_the_stage_communication(tmp_path, smollm_gguf):
    result = _run(["latency", "--model", MODEL, "--input-len", "8", "--output-len", "4",
                   "--num-iters", "1", "-pp", "2"], tmp_path / "r.json")
    # the timed request only (the warm-up's steps are reset): a prefill and three decode steps
    assert result["pp_steps"] == 4
    assert result["pp_rank0_send_ms_per_step"] > 0 and result["pp_rank1_recv_ms_per_step"] > 0
    hidden = 576  # SmolLM2-135M: the residual and the layer output, float32, 8 + 3 tokens
    assert result["pp_bytes_per_step"] == 2 * hidden * 4 * (8 + 3) / 4
    assert "pp_rank1_send_ms_per_step" not in result and "pp_rank0_recv_ms_per_step" not in result


def test_tensor_parallel_reports_the_collectives(tmp_path, qwen_gguf):
    """Qwen2.5-0.5B at -tp 2 with its K-quant blocks kept (split 10/9 blocks): per step, one
    all-reduce for the embedding and two for each of the 24 layers, of the step's hidden
    states; no pipeline keys."""
    result = _run(["latency", "--model", str(qwen_gguf), "--input-len", "8", "--output-len",
                   "4", "--num-iters", "1", "-tp", "2"], tmp_path / "r.json")
    assert result["tp_steps"] == 4  # the timed request's prefill and three decode steps
    assert result["tp_allreduces_per_step"] == 1 + 2 * 24
    hidden = 896
    assert result["tp_allreduce_bytes_per_step"] == 49 * hidden * 4 * (8 + 3) / 4
    for rank in (0, 1):
        assert result[f"tp_rank{rank}_allreduce_ms_per_step"] > 0
        assert result[f"tp_rank{rank}_allgather_ms_per_step"] > 0
    assert result["tp_allreduce_ms_per_step"] == min(result["tp_rank0_allreduce_ms_per_step"],
                                                     result["tp_rank1_allreduce_ms_per_step"])
    assert not any(key.startswith("pp_") for key in result)


def test_tensor_and_pipeline_parallel_together_report_both(tmp_path, qwen_gguf):
    """-tp 2 -pp 2 (four ranks; global rank = stage x 2 + TP rank): stage 0's TP ranks
    all-reduce for the embedding and two for each of its 12 layers, and send the residual
    stream to stage 1's; the report has the collectives and the sends and receives."""
    result = _run(["latency", "--model", str(qwen_gguf), "--input-len", "8", "--output-len",
                   "3", "--num-iters", "1", "--num-iters-warmup", "0", "-tp", "2", "-pp", "2"],
                  tmp_path / "r.json")
    assert result["tp_allreduces_per_step"] == 1 + 2 * 12
    assert result["pp_steps"] == 3
    assert result["pp_bytes_per_step"] == 2 * 896 * 4 * (8 + 2) / 3  # [2, T, H] float32
    for rank in (0, 1):
        assert result[f"pp_rank{rank}_send_ms_per_step"] > 0
    for rank in (2, 3):
        assert result[f"pp_rank{rank}_recv_ms_per_step"] > 0
        assert result[f"tp_rank{rank}_allgather_ms_per_step"] > 0  # the last stage's logits


@pytest.mark.parametrize("flag,value,least", [("--input-len", "0", 1), ("--output-len", "0", 1),
                                              ("--num-prompts", "0", 1), ("--num-iters", "0", 1),
                                              ("--num-iters-warmup", "-1", 0)])
def test_lengths_and_counts_are_checked(flag, value, least):
    proc = subprocess.run(CLI + ["latency", flag, value], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2
    assert f"argument {flag}: must be an integer of at least {least}, got '{value}'" in proc.stderr


def test_sampled_requests(tmp_path, smollm_gguf):
    """--temperature / --top-p / --top-k (vLLM's bench serve names) sample every request; the
    requests still run to --output-len; the result says how they were sampled."""
    result = _run(["throughput", "--model", MODEL, "--dtype", "float32", "--input-len", "16",
                   "--output-len", "8", "--num-prompts", "4", "--temperature", "0.8",
                   "--top-p", "0.95", "--top-k", "40"], tmp_path / "r.json")
    assert result["sampling"] == "temperature 0.8, top_p 0.95, top_k 40"
    assert result["output_tokens"] == 4 * 8
    from pagedllm.entrypoints.bench import _params  # what every offline request is given

    params = _params(argparse.Namespace(output_len=8, temperature=0.8, top_p=0.95, top_k=40,
                                        structured_output="none"))
    assert (params.temperature, params.top_p, params.top_k) == (0.8, 0.95, 40)
    assert params.ignore_eos and params.max_tokens == 8


@pytest.mark.parametrize("flag,value,allowed", [("--top-p", "0", "(0, 1]"),
                                                ("--top-p", "1.5", "(0, 1]"),
                                                ("--temperature", "-1", "[0, inf]")])
def test_sampling_flags_are_checked(flag, value, allowed):
    proc = subprocess.run(CLI + ["throughput", flag, value], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2
    assert f"argument {flag}: must be in {allowed}, got {float(value)}" in proc.stderr


def test_serve_mode_against_a_running_server(server, tmp_path):
    result = _run(["serve", "--url", server.url, "--api-key", API_KEY, "--num-prompts", "6",
                   "--max-concurrency", "3", "--input-len", "16", "--output-len", "8",
                   "--temperature", "0.7", "--top-p", "0.9"],
                  tmp_path / "s.json")
    assert result["model"] == MODEL and result["output_tokens"] == 6 * 8
    assert result["sampling"] == "temperature 0.7, top_p 0.9, top_k -1"
    for key in ("output_tok_per_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s"):
        assert result[key] > 0, key
    assert result["ttft_p50_s"] <= result["ttft_p99_s"]


class _OneAnswerPerConnection:
    """An OpenAI-style SSE server on loopback that answers one request per keep-alive connection
    and closes the connection, unanswered, when a second request comes on it (what clients of
    llama-server see: 'Server disconnected without sending a response')."""

    def __init__(self) -> None:
        import socket
        import threading

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.dropped = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import threading

        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    @staticmethod
    def _read_request(conn) -> bytes:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                return b""
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        while len(body) < length:
            body += conn.recv(65536)
        return head

    def _serve(self, conn) -> None:
        with conn:
            head = self._read_request(conn)
            if not head:
                return
            if head.startswith(b"GET"):
                payload = b'{"object": "list", "data": [{"id": "m", "object": "model"}]}'
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\n\r\n%s" % (len(payload), payload))
            else:
                events = b"".join(b'data: {"choices": [{"index": 0, "text": "t%d"}]}\n\n' % k
                                  for k in range(4))
                events += b'data: {"choices": [], "usage": {"completion_tokens": 4}}\n\n'
                events += b"data: [DONE]\n\n"
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"content-length: %d\r\n\r\n%s" % (len(events), events))
            if self._read_request(conn):  # a second request on this connection: drop it
                self.dropped += 1

    def close(self) -> None:
        self.sock.close()


def test_serve_mode_retries_a_connection_the_server_closed(tmp_path):
    srv = _OneAnswerPerConnection()
    try:
        proc = subprocess.run(
            CLI + ["serve", "--url", srv.url, "--num-prompts", "8", "--max-concurrency", "2",
                   "--input-len", "4", "--output-len", "4", "--output-json", str(tmp_path / "r.json")],
            capture_output=True, text=True, timeout=120)
    finally:
        srv.close()
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["output_tokens"] == 8 * 4
    assert result["retried_requests"] >= 1 and result["retried_requests"] == srv.dropped
    assert "retried_requests" in proc.stdout


def test_throughput_spreads_the_requests_over_lora_adapters(tmp_path, smollm_gguf,
                                                           smollm_lora_adapters):
    """--lora-modules (enable_lora implied): the requests round-robin over the adapters, which
    share each batch with --max-loras 2; vLLM's --lora-path: one adapter under ids 1 to
    --max-loras, spread at random (seeded) or round-robin; a value without a path is refused
    naming the flag."""
    from argparse import Namespace

    from pagedllm.entrypoints.bench import _spread_loras

    def spread(**kw):
        args = dict(lora_modules=None, lora_path=None, lora_assignment=None, max_loras=3,
                    num_prompts=5, model=MODEL)
        return _spread_loras(Namespace(**{**args, **kw}))

    modules = [f"{a.lora_name}={a.lora_path}" for a in smollm_lora_adapters]
    assert [a.lora_name for a in spread(lora_modules=modules)] == ["adapter1", "adapter2"] * 2 + [
        "adapter1"]
    assert spread() is None
    path = smollm_lora_adapters[0].lora_path
    robin = spread(lora_path=path, lora_assignment="round-robin")
    assert [(a.lora_name, a.lora_int_id, a.lora_path) for a in robin] == [
        (str(i), i, path) for i in (1, 2, 3, 1, 2)]
    drawn = spread(lora_path=path, num_prompts=40)  # random, vLLM's default for --lora-path
    assert drawn == spread(lora_path=path, num_prompts=40)  # seeded
    assert {a.lora_int_id for a in drawn} == {1, 2, 3} and drawn[:5] != robin
    for kw, flag in [(dict(lora_path=path, lora_modules=modules), "--lora-path and "
                      "--lora-modules"), (dict(lora_assignment="random"), "--lora-assignment")]:
        with pytest.raises(SystemExit, match=flag):
            spread(**kw)
    result = _run(["throughput", "--model", MODEL, "--input-len", "16", "--output-len", "8",
                   "--num-prompts", "4", "--max-loras", "2", "--max-lora-rank", "8",
                   "--lora-modules", *modules], tmp_path / "r.json")
    assert result["output_tokens"] == 4 * 8 and result["output_tok_per_s"] > 0
    assert result["lora_adapters"] == 2 and result["max_loras"] == 2
    result = _run(["throughput", "--model", MODEL, "--input-len", "16", "--output-len", "8",
                   "--num-prompts", "4", "--max-loras", "2", "--max-lora-rank", "8",
                   "--lora-path", path, "--lora-assignment", "round-robin"], tmp_path / "p.json")
    assert result["output_tokens"] == 4 * 8 and result["lora_adapters"] == 2
    proc = subprocess.run(CLI + ["throughput", "--model", MODEL, "--lora-modules", "broken"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "--lora-modules 'broken'" in proc.stderr
