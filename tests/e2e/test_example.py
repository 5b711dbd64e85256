"""The Qwen documentation example, pointed at the default model, runs and answers coherently."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "qwen_offline.py"


def test_qwen_offline_example_prints_a_coherent_answer(qwen_gguf):
    proc = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    match = re.search(r"Prompt: '(.*)', Generated text: (['\"])(.*)\2$", proc.stdout, re.S)
    assert match, proc.stdout[-2000:]
    assert "<|im_start|>assistant" in match.group(1)
    answer = match.group(3)
    words = re.findall(r"[A-Za-z]+", answer)
    print(answer)
    assert len(words) >= 40, answer  # a real paragraph, not a few tokens
    assert sum(c.isascii() for c in answer) / len(answer) > 0.95, answer  # English, no garbage
    assert re.search(r"language model|LLM", answer, re.I), answer  # on topic
