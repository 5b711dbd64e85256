"""`pagedllm doctor` reports the KV bytes a token in the dtype the engine keeps its cache in:
bf16 under a bf16 checkpoint's bf16 matrices on the CPU, float32 under GGUF blocks."""
from __future__ import annotations

from e2e.helpers import save_bf16_export
from pagedllm.entrypoints import doctor
from pagedllm.loader.checkpoint import resolve_checkpoint
from pagedllm.memory.footprint import kv_bytes_per_token


def test_doctor_counts_the_kv_cache_in_its_own_dtype(smollm_hf_dir, smollm_gguf, tmp_path):
    bf16_dir = save_bf16_export(smollm_hf_dir, tmp_path)
    report = doctor.model_report(str(bf16_dir), device="cpu", max_model_len=512)
    assert report["fits"] and report["quantization"] == "bf16" and report["dtype"] == "float32"
    bf16_arch = resolve_checkpoint(str(bf16_dir)).arch
    assert report["kv_bytes_per_token"] == kv_bytes_per_token(bf16_arch, 2)
    report = doctor.model_report(str(smollm_gguf), device="cpu", max_model_len=512)
    assert report["fits"] and report["quantization"] == "gguf"
    gguf_arch = resolve_checkpoint(str(smollm_gguf)).arch
    assert report["kv_bytes_per_token"] == kv_bytes_per_token(gguf_arch, 4)
