"""Hub downloads through huggingface_hub's real client against a loopback fake Hub (never huggingface.co)."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
from safetensors.numpy import save_file

from pagedllm.loader.checkpoint import resolve_checkpoint
from pagedllm.loader.gguf.weights import arch_from_gguf
from pagedllm.hub.hub import HubError, HubRef, PreparedModel, parse_hub_ref, prepare_hub_model
from pagedllm.loader.metadata import checkpoint_num_params
from fake_hub import FakeHub, FakeRepo, closed_port

HF_REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"
GGUF_REPO = "test/SmolLM2-GGUF"
GATED_REPO = "test/gated-GGUF"
BIN_REPO = "test/bin-only"
SINGLE_REPO = "test/single-file"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DECOY_GGUF = "SmolLM2-135M-Instruct.Q8_0.gguf"
TOKEN = "hf_test_token"
BIG_REPO = "Qwen/Qwen2-7B-Instruct"  # its real config and index, no weights


@pytest.fixture(scope="module")
def hub(smollm_hf_dir: Path, smollm_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeHub]:
    """The fake Hub serving SmolLM2 as an HF repo (with decoys), as GGUF repos, and a .bin-only repo."""
    decoys = tmp_path_factory.mktemp("decoys")
    for name in ("pytorch_model.bin", "consolidated.pth", DECOY_GGUF, "README.md"):
        (decoys / name).write_bytes(b"decoy " + name.encode())
    hf_files = {p.name: p for p in smollm_hf_dir.iterdir() if p.is_file() and not p.name.startswith(".")}
    hf_files.update({"pytorch_model.bin": decoys / "pytorch_model.bin", "README.md": decoys / "README.md",
                     "original/consolidated.pth": decoys / "consolidated.pth"})
    gguf_files = {GGUF_NAME: smollm_gguf, DECOY_GGUF: decoys / DECOY_GGUF, "README.md": decoys / "README.md"}
    repos = {HF_REPO: FakeRepo(hf_files), GGUF_REPO: FakeRepo(gguf_files),
             GATED_REPO: FakeRepo({GGUF_NAME: smollm_gguf}, gated=True),
             BIN_REPO: FakeRepo({"config.json": smollm_hf_dir / "config.json",
                                 "pytorch_model.bin": decoys / "pytorch_model.bin"})}
    shapes = Path(__file__).resolve().parents[1] / "data" / "qwen2-7b-instruct-shapes"
    big = {"config.json": shapes / "config.json",
           "model.safetensors.index.json": shapes / "model.safetensors.index.json"}
    for i in range(1, 5):  # listed like the real shards; the test fails if one is requested
        name = f"model-0000{i}-of-00004.safetensors"
        (decoys / name).write_bytes(b"not fetched")
        big[name] = decoys / name
    repos[BIG_REPO] = FakeRepo(big)
    save_file({"w": np.zeros((64, 32), dtype=np.float32)}, str(decoys / "model.safetensors"))
    repos[SINGLE_REPO] = FakeRepo({"config.json": smollm_hf_dir / "config.json",
                                   "model.safetensors": decoys / "model.safetensors"})
    with FakeHub(repos, token=TOKEN) as server:
        yield server


def _point_at(mp: pytest.MonkeyPatch, endpoint: str, home: Path, offline: bool = False) -> None:
    """Environment of a user whose HF_ENDPOINT is `endpoint` and whose caches live in `home`."""
    mp.setenv("HF_ENDPOINT", endpoint)
    mp.setenv("HF_HOME", str(home))
    mp.setenv("HF_HUB_CACHE", str(home / "hub"))
    mp.setenv("PAGEDLLM_CACHE_DIR", str(home / "pagedllm"))
    mp.setenv("HF_HUB_OFFLINE", "1" if offline else "0")
    for var in ("HF_TOKEN", "PAGEDLLM_USE_MODELSCOPE", "VLLM_USE_MODELSCOPE"):
        mp.delenv(var, raising=False)


@pytest.fixture
def env(hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeHub:
    """A fresh, empty cache pointed at the fake Hub; the request log starts empty."""
    _point_at(monkeypatch, hub.url, tmp_path)
    hub.clear_log()
    return hub


@dataclass(frozen=True)
class _Download:
    """The HF repo prepared and fetched once per module (540 MB), with what each phase requested."""

    home: Path
    prepared: PreparedModel
    metadata_requests: list[str]
    metadata_plan: tuple[int, str]  # checkpoint_num_params on metadata_path before the weights came
    metadata_layers: int
    weights_path: str
    all_requests: list[str]


@pytest.fixture(scope="module")
def hf_download(hub: FakeHub, tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Download]:
    """Prepare and fetch HF_REPO into a module-wide HF_HOME."""
    home = tmp_path_factory.mktemp("hf-home")
    with pytest.MonkeyPatch.context() as mp:
        _point_at(mp, hub.url, home)
        hub.clear_log()
        prepared = prepare_hub_model(parse_hub_ref(HF_REPO))
        metadata_requests = hub.files_requested(HF_REPO)
        ckpt = resolve_checkpoint(prepared.metadata_path)  # what the memory planner sees
        plan = checkpoint_num_params(ckpt)
        path = prepared.fetch_weights()
        yield _Download(home, prepared, metadata_requests, plan, ckpt.arch.num_hidden_layers, path,
                        hub.files_requested(HF_REPO))


def test_parse_hub_ref() -> None:
    assert parse_hub_ref("Qwen/Qwen2-0.5B-Instruct") == HubRef("Qwen/Qwen2-0.5B-Instruct", None, None, None)
    assert parse_hub_ref("Qwen/Qwen2-0.5B-Instruct-GGUF:qwen2-0_5b-instruct-q4_k_m.gguf", revision="v1") == \
        HubRef("Qwen/Qwen2-0.5B-Instruct-GGUF", "v1", "qwen2-0_5b-instruct-q4_k_m.gguf", None)
    assert parse_hub_ref("Qwen/Qwen2-0.5B-Instruct-GGUF:Q4_K_M").quant_tag == "Q4_K_M"
    assert parse_hub_ref("o/n", gguf_file="x.gguf").gguf_file == "x.gguf"
    for not_a_ref in ("model.gguf", "/abs/path", "./rel/dir", "a/b/c", "~/m", "qwen2.5-coder-0.5b-instruct"):
        assert parse_hub_ref(not_a_ref) is None, not_a_ref
    with pytest.raises(ValueError, match="quantization tag"):
        parse_hub_ref("o/n:bad tag!")


def test_hf_repo_metadata_before_weights(hf_download: _Download) -> None:
    needed_meta = {"config.json", "generation_config.json", "model.safetensors.index.json",
                   "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}
    assert set(hf_download.metadata_requests) == needed_meta  # no weight byte before the plan
    assert hf_download.metadata_layers == 30
    n_params, source = hf_download.metadata_plan
    assert source == "safetensors index total_size" and 130e6 < n_params < 140e6


def test_hf_repo_fetches_only_needed_files_and_loads(hf_download: _Download, smollm_hf_dir: Path,
                                                     sha256) -> None:
    shards = {f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)}
    requested = hf_download.all_requests
    assert sorted(requested) == sorted(set(requested))  # nothing fetched twice: the cache was reused
    assert set(requested) - set(hf_download.metadata_requests) == shards
    assert not [r for r in requested if r.endswith((".bin", ".pth")) or "/" in r or r == "README.md"]
    path = Path(hf_download.weights_path)
    assert sha256(path / "model-00003-of-00003.safetensors") == \
        sha256(smollm_hf_dir / "model-00003-of-00003.safetensors")

    from pagedllm import LLM, SamplingParams

    llm = LLM(model=str(path), dtype="float32", max_model_len=256)
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=4))
    assert out[0].outputs[0].token_ids


def test_offline_reuses_cache_in_fresh_process(hf_download: _Download) -> None:
    # a new process, HF_HUB_OFFLINE=1 and nothing listening: only the cache can answer
    script = ("import sys; from pagedllm.hub.hub import parse_hub_ref, prepare_hub_model;"
              f"p = prepare_hub_model(parse_hub_ref({HF_REPO!r}));"
              "print(p.metadata_path); print(p.fetch_weights())")
    env = {**os.environ, "HF_HOME": str(hf_download.home), "HF_HUB_CACHE": str(hf_download.home / "hub"),
           "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": f"http://127.0.0.1:{closed_port()}"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          timeout=60, cwd=Path(__file__).parents[2])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [hf_download.weights_path, hf_download.weights_path]


def test_offline_uncached_repo_is_a_clear_error(env: FakeHub, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubError, match=r"'test/SmolLM2-GGUF'.*not cached.*HF_HUB_OFFLINE=1"):
        prepare_hub_model(parse_hub_ref(f"{GGUF_REPO}:Q4_1"))
    assert env.log == []


@pytest.mark.parametrize("model", [f"{GGUF_REPO}:q4_1", f"{GGUF_REPO}:{GGUF_NAME}"])
def test_gguf_header_by_range_then_file(env: FakeHub, smollm_gguf: Path, model: str, sha256) -> None:
    prepared = prepare_hub_model(parse_hub_ref(model))
    size = smollm_gguf.stat().st_size
    gets = [r for r in env.log if r.method == "GET" and "/resolve/" in r.path]
    assert gets and all(r.path.endswith(GGUF_NAME) and r.range for r in gets)  # header only, by Range
    assert os.path.getsize(prepared.metadata_path) < size // 10
    ckpt = resolve_checkpoint(prepared.metadata_path)
    assert ckpt.arch == arch_from_gguf(smollm_gguf)
    assert checkpoint_num_params(ckpt) == checkpoint_num_params(resolve_checkpoint(smollm_gguf))

    env.cut_once(GGUF_NAME, 10 << 20)  # the download is interrupted after 10 MiB and resumes
    path = prepared.fetch_weights()
    assert Path(path).name == GGUF_NAME and sha256(path) == sha256(smollm_gguf)
    full = [r for r in env.log if r.method == "GET" and r.path.endswith(GGUF_NAME)][len(gets):]
    assert [r.range for r in full] == [None, f"bytes={10 << 20}-"]
    assert DECOY_GGUF not in env.files_requested(GGUF_REPO) + env.files_requested(GGUF_REPO, "HEAD")


def test_gguf_tag_matching_nothing_lists_files(env: FakeHub) -> None:
    with pytest.raises(ValueError, match=rf"'Q5_K_M' matches 0 .gguf files.*{GGUF_NAME}, {DECOY_GGUF}"):
        prepare_hub_model(parse_hub_ref(f"{GGUF_REPO}:Q5_K_M"))
    with pytest.raises(ValueError, match="matches 2 .gguf files"):
        prepare_hub_model(parse_hub_ref(GGUF_REPO))


def test_bin_only_repo_needs_safetensors(env: FakeHub) -> None:
    with pytest.raises(ValueError, match="only PyTorch .bin/.pt weights; safetensors"):
        prepare_hub_model(parse_hub_ref(BIN_REPO))


def test_single_unindexed_safetensors_planned_from_its_header(env: FakeHub) -> None:
    prepared = prepare_hub_model(parse_hub_ref(SINGLE_REPO))
    gets = [r for r in env.log if r.method == "GET" and r.path.endswith("model.safetensors")]
    assert gets and all(r.range for r in gets)  # only the JSON header, by Range
    assert checkpoint_num_params(resolve_checkpoint(prepared.metadata_path)) == (64 * 32, "safetensors headers")
    path = Path(prepared.fetch_weights())
    assert path != prepared.metadata_path and (path / "model.safetensors").stat().st_size > 64 * 32 * 4


def test_missing_repo(env: FakeHub) -> None:
    with pytest.raises(HubError, match=rf"'test/no-such-model' was not found at {env.url}"):
        prepare_hub_model(parse_hub_ref("test/no-such-model"))


def test_gated_repo_needs_token(env: FakeHub, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(HubError, match="gated or private.*set HF_TOKEN"):
        prepare_hub_model(parse_hub_ref(f"{GATED_REPO}:Q4_1"))
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    prepared = prepare_hub_model(parse_hub_ref(f"{GATED_REPO}:Q4_1"))
    assert resolve_checkpoint(prepared.metadata_path).kind == "gguf"


def test_unreachable_endpoint_fails_fast_naming_it(env: FakeHub, monkeypatch: pytest.MonkeyPatch) -> None:
    endpoint = f"http://127.0.0.1:{closed_port()}"
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    start = time.monotonic()
    with pytest.raises(HubError) as info:
        prepare_hub_model(parse_hub_ref(HF_REPO))
    assert time.monotonic() - start < 5
    message = str(info.value)
    assert "\n" not in message and endpoint in message
    for way_out in ("HF_ENDPOINT=https://hf-mirror.com", "PAGEDLLM_USE_MODELSCOPE=1", "local path", "HF_HUB_OFFLINE=1"):
        assert way_out in message


def test_modelscope_not_installed(env: FakeHub, monkeypatch: pytest.MonkeyPatch) -> None:
    if importlib.util.find_spec("modelscope") is not None:
        pytest.skip("modelscope is installed here")
    monkeypatch.setenv("VLLM_USE_MODELSCOPE", "1")
    with pytest.raises(HubError, match="pip install modelscope"):
        prepare_hub_model(parse_hub_ref(HF_REPO))
    monkeypatch.delenv("VLLM_USE_MODELSCOPE")
    with pytest.raises(HubError, match="pip install modelscope"):
        prepare_hub_model(parse_hub_ref(HF_REPO), source="modelscope")
    assert env.log == []


def test_llm_loads_hub_repos_by_id_and_by_quant_tag(env: FakeHub) -> None:
    """LLM(model="owner/name") and LLM(model="owner/name:TAG") fetch, plan, load and generate."""
    from pagedllm import LLM, SamplingParams

    for model in (HF_REPO, f"{GGUF_REPO}:Q4_1"):
        llm = LLM(model=model, dtype="float32", max_model_len=256)
        out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=4),
                           use_tqdm=False)[0]
        assert out.outputs[0].text.strip(), model
    assert DECOY_GGUF not in env.files_requested(GGUF_REPO)


def test_a_model_that_cannot_fit_is_refused_before_any_weight_byte(env: FakeHub, monkeypatch) -> None:
    """Fit before fetch: Qwen2-7B on a 3.5 GiB machine is refused from config + index alone."""
    from pagedllm import LLM
    from pagedllm.platforms.cpu import CpuPlatform
    from pagedllm.platforms.interface import MemoryInfo
    from pagedllm.memory.plan import InsufficientMemoryError

    small = MemoryInfo(int(3.49 * 1024 ** 3), int(3.1 * 1024 ** 3), "cgroup v1 limit 3.49 GiB")
    monkeypatch.setattr(CpuPlatform, "memory", lambda self: small)
    started = time.monotonic()
    with pytest.raises(InsufficientMemoryError, match="does not fit in memory"):
        LLM(model=BIG_REPO)
    assert time.monotonic() - started < 5
    requested = env.files_requested(BIG_REPO)
    assert "config.json" in requested
    assert not [f for f in requested if f.endswith(".safetensors")]
