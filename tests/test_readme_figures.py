"""benchmarks/readme_figures.py's table: README's markdown form, ranges, blank peer cells, and
llama-bench's JSON read (no benchmark runs here)."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "readme_figures.py"
_spec = importlib.util.spec_from_file_location("readme_figures", _PATH)
readme_figures = importlib.util.module_from_spec(_spec)
sys.modules["readme_figures"] = readme_figures  # dataclasses look their module up there
_spec.loader.exec_module(readme_figures)


def test_cells_are_ranges_with_the_rows_unit():
    assert readme_figures.cell([524.31, 502.04, 510.0], "tok/s") == "502.0-524.3 tok/s"
    assert readme_figures.cell([1.128, 1.333], "s") == "1.13-1.33 s"
    assert readme_figures.cell([174.3, 174.32]) == "174.3"  # equal once rounded: one value
    assert readme_figures.cell([]) == ""


def test_table_has_readmes_rows_and_leaves_unmeasured_peers_blank():
    figures = readme_figures.Figures()
    for value in (55.6, 55.8):
        figures.add("decode", "pagedllm", value)
    figures.add("decode", "llama.cpp", 38.4)
    figures.add("ttft", "vllm", 3.15)
    text = readme_figures.table(figures, "Qwen2.5-Coder-0.5B-Instruct Q4_K_M", "AMD EPYC 9R14",
                                ["avx2", "avx512f"], "2026-12-02", 2)
    lines = text.splitlines()
    assert lines[0] == ("Default model (Qwen2.5-Coder-0.5B-Instruct Q4_K_M), 2 threads, llama.cpp "
                        "and vLLM's CPU build run side by side in the same sitting, on AMD EPYC "
                        "9R14 (avx2, avx512f), 2026-12-02:")
    assert lines[2:4] == ["| | pagedllm | llama.cpp (same GGUF) | vLLM CPU (bf16) |",
                          "|---|---|---|---|"]
    assert lines[4:] == [
        "| prompt processing, 512 tokens |  |  |  |",
        "| one-stream decode, short context | 55.6-55.8 tok/s | 38.4 |  |",
        "| offline 32 x (100 + 128), output tok/s |  |  |  |",
        "| server, 48 requests at concurrency 16, output tok/s |  |  |  |",
        "| server, time to first token p50 |  |  | 3.15 s |"]


def test_unknown_rows_and_engines_are_refused_by_name():
    with pytest.raises(ValueError, match="row must be one of"):
        readme_figures.Figures().add("prefil", "pagedllm", 1.0)
    with pytest.raises(ValueError, match="'llamacpp'"):
        readme_figures.Figures().add("prefill", "llamacpp", 1.0)


def test_llama_bench_json_gives_pp512_and_tg128():
    out = json.dumps([{"n_prompt": 512, "n_gen": 0, "avg_ts": 210.5},
                      {"n_prompt": 0, "n_gen": 128, "avg_ts": 38.25}])
    assert readme_figures.llama_bench_figures(out) == {"prefill": 210.5, "decode": 38.25}
