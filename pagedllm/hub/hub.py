"""Fetch models from the Hugging Face Hub (or a mirror, or ModelScope): metadata first, weights on demand."""
from __future__ import annotations

import contextlib
import io
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

from pagedllm.paths import hub_headers_dir

_META_FILES = frozenset({
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "tokenizer.model", "vocab.json", "merges.txt", "special_tokens_map.json", "added_tokens.json",
    "chat_template.json", "chat_template.jinja",
})
_TORCH_WEIGHTS = (".bin", ".pth", ".pt")
_REPO_RE = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")
_TAG_RE = re.compile(r"^[A-Za-z0-9_]+$")
_HEADER_FIRST_READ = 1 << 20  # GGUF headers are ~1-10 MiB (the vocabulary lives there); grow x4
_TRUE = ("1", "true", "yes", "on")
_WAYS_OUT = ("ways out: set HF_ENDPOINT to a mirror (e.g. HF_ENDPOINT=https://hf-mirror.com), "
             "use ModelScope (PAGEDLLM_USE_MODELSCOPE=1 with `pip install modelscope`), "
             "pass a local path, or set HF_HUB_OFFLINE=1 to use a cached copy")


class HubError(RuntimeError):
    """A model could not be fetched; the message is one line saying why and what to do."""


@dataclass(frozen=True)
class HubRef:
    """A model on the Hub: a repo, optionally one GGUF file in it (by name or quantization tag)."""

    repo_id: str
    revision: Optional[str] = None
    gguf_file: Optional[str] = None
    quant_tag: Optional[str] = None


@dataclass(frozen=True)
class PreparedModel:
    """Metadata on local disk (enough to plan memory) and a callable that fetches the weights."""

    metadata_path: Path  # an HF dir without weights, or a .gguf file holding only the header
    fetch_weights: Callable[[], str]  # downloads (progress bar) and returns the path to load


@dataclass(frozen=True)
class _Settings:
    """Hub settings read from the environment at call time (so a script may set them late)."""

    endpoint: str
    cache_dir: str
    offline: bool
    timeout: float


def _settings() -> _Settings:
    """HF_ENDPOINT, HF_HUB_CACHE / HF_HOME, HF_HUB_OFFLINE, HF_HUB_ETAG_TIMEOUT, falling back to huggingface_hub."""
    from huggingface_hub import constants

    env = os.environ
    home = env.get("HF_HOME")
    cache = env.get("HF_HUB_CACHE") or (os.path.join(home, "hub") if home else constants.HF_HUB_CACHE)
    offline_env = env.get("HF_HUB_OFFLINE") or env.get("TRANSFORMERS_OFFLINE")
    offline = offline_env.lower() in _TRUE if offline_env is not None else constants.HF_HUB_OFFLINE
    return _Settings(endpoint=(env.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/"),
                     cache_dir=os.path.expanduser(cache), offline=offline,
                     timeout=float(env.get("HF_HUB_ETAG_TIMEOUT") or 10))


def hub_cache_dir() -> Path:
    """The Hugging Face Hub cache downloads go to (HF_HUB_CACHE, else HF_HOME/hub, else
    huggingface_hub's default), read now."""
    return Path(_settings().cache_dir)


def parse_hub_ref(model: str, revision: Optional[str] = None,
                  gguf_file: Optional[str] = None) -> Optional[HubRef]:
    """HubRef for "owner/name", "owner/name:file.gguf" or "owner/name:TAG"; None if it is not one."""
    repo, _, suffix = model.strip().partition(":")
    if not _REPO_RE.match(repo) or repo.endswith(".gguf") or ".." in repo:
        return None
    tag = None
    if suffix.lower().endswith(".gguf"):
        if gguf_file is not None and gguf_file != suffix:
            raise ValueError(f"model={model!r} names GGUF file {suffix!r} but gguf_file={gguf_file!r}; "
                             "give the file once")
        gguf_file = suffix
    elif suffix:
        if not _TAG_RE.match(suffix):
            raise ValueError(f"model={model!r}: {suffix!r} after ':' is neither a .gguf file name "
                             "nor a quantization tag like Q4_K_M")
        tag = suffix
    return HubRef(repo_id=repo, revision=revision, gguf_file=gguf_file, quant_tag=tag)


def _use_modelscope(source: Optional[str]) -> bool:
    """True when source="modelscope" or PAGEDLLM_USE_MODELSCOPE / VLLM_USE_MODELSCOPE is set."""
    if source not in (None, "hf", "huggingface", "modelscope"):
        raise ValueError(f"source={source!r} is not supported; use 'huggingface' or 'modelscope'")
    flags = (os.environ.get(k, "").lower() for k in ("PAGEDLLM_USE_MODELSCOPE", "VLLM_USE_MODELSCOPE"))
    return source == "modelscope" or (source is None and any(f in _TRUE for f in flags))


@contextlib.contextmanager
def _hub_errors(ref: HubRef, s: _Settings) -> Iterator[None]:
    """Turn huggingface_hub / network exceptions into one-line HubErrors."""
    import httpx2
    from huggingface_hub import errors

    repo = f"repo {ref.repo_id!r}"
    try:
        yield
    except (httpx2.ConnectError, httpx2.TimeoutException) as exc:
        raise HubError(f"cannot reach the Hugging Face Hub at {s.endpoint} to fetch {repo} "
                       f"({type(exc).__name__}: {exc}); {_WAYS_OUT}") from None
    except errors.GatedRepoError:
        raise HubError(f"{repo} is gated or private: accept its terms at {s.endpoint}/{ref.repo_id} "
                       "and set HF_TOKEN to an access token of your account") from None
    except errors.RevisionNotFoundError:
        raise HubError(f"{repo} has no revision {ref.revision!r} at {s.endpoint}") from None
    except errors.RepositoryNotFoundError:
        raise HubError(f"{repo} was not found at {s.endpoint}: check the name "
                       "(if it is private, set HF_TOKEN)") from None
    except errors.HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else "?"
        hint = "; set HF_TOKEN to an access token" if status in (401, 403) else ""
        raise HubError(f"the Hub at {s.endpoint} answered HTTP {status} for {repo}{hint}") from None


def _exact(name: str) -> str:
    """An fnmatch pattern matching exactly `name`."""
    return re.sub(r"([*?\[])", r"[\1]", name)


def _pick_gguf(ref: HubRef, names: list[str]) -> str:
    """The .gguf file the ref means: its explicit name, or the one whose name carries its tag."""
    ggufs = sorted(n for n in names if n.lower().endswith(".gguf"))
    listing = ", ".join(ggufs) or "none"
    if ref.gguf_file is not None:
        if ref.gguf_file in ggufs:
            return ref.gguf_file
        raise ValueError(f"gguf_file={ref.gguf_file!r} is not in repo {ref.repo_id!r}; "
                         f"its .gguf files: {listing}")
    if ref.quant_tag is None:
        matches = ggufs
    else:  # the tag as a whole token: Q4_K must not match q4_k_m
        tag = re.compile(rf"(?<![a-z0-9]){re.escape(ref.quant_tag.lower())}(?![a-z0-9_])")
        matches = [n for n in ggufs if tag.search(n.rsplit("/", 1)[-1].lower())]
    if len(matches) == 1:
        return matches[0]
    what = f"quantization tag {ref.quant_tag!r}" if ref.quant_tag else "no file name or tag"
    raise ValueError(f"{what} matches {len(matches)} .gguf files in repo {ref.repo_id!r}; "
                     f"pick one with 'repo:FILE.gguf'; its .gguf files: {listing}")


def _hf_selection(repo_id: str, names: list[str]) -> tuple[list[str], list[str]]:
    """(metadata files, weight files) to fetch from an HF repo's top-level files."""
    top = [n for n in names if "/" not in n]  # never original/ or other subfolders
    weights = sorted(n for n in top if n.endswith(".safetensors"))
    if not weights:
        if any(n.endswith(_TORCH_WEIGHTS) for n in top):
            raise ValueError(f"repo {repo_id!r} has only PyTorch .bin/.pt weights; safetensors "
                             "(or a GGUF repo) are required")
        raise ValueError(f"repo {repo_id!r} has neither *.safetensors weights nor .gguf files")
    if "config.json" not in top:
        raise ValueError(f"repo {repo_id!r} has *.safetensors but no config.json")
    meta = sorted(n for n in top if n in _META_FILES or n.endswith(".safetensors.index.json"))
    return meta, weights


def _header_dir() -> Path:
    """Where header-only stubs live: $PAGEDLLM_CACHE_DIR/hub-headers (never inside the HF cache)."""
    return hub_headers_dir()


def _range_reader(ref: HubRef, s: _Settings, filename: str, commit: str) -> Callable[[int, int], bytes]:
    """A function (start, end) -> those bytes of one file, via HTTP Range requests."""
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    url = hf_hub_url(ref.repo_id, filename, revision=commit, endpoint=s.endpoint)

    def read(start: int, end: int) -> bytes:
        headers = {**build_hf_headers(), "Range": f"bytes={start}-{end - 1}", "Accept-Encoding": "identity"}
        r = get_session().get(url, headers=headers, timeout=s.timeout, follow_redirects=True)
        hf_raise_for_status(r)
        return r.content if r.status_code == 206 else r.content[start:end]

    return read


def _fetch_gguf_header(read: Callable[[int, int], bytes], size: int, name: str) -> bytes:
    """The smallest prefix of a remote GGUF (growing x4) that holds its whole header, whose
    tensors all lie inside the remote file's size."""
    from pagedllm.loader.gguf.header import check_tensor_extents, read_gguf_header  # gguf: only here

    data = b""
    want = _HEADER_FIRST_READ
    while True:
        want = min(want, size)
        data += read(len(data), want)
        try:
            tensors = read_gguf_header(io.BytesIO(data), name)[1]
            break
        except ValueError:
            if want >= size:
                raise
        want *= 4
    check_tensor_extents(tensors, size, name)
    return data


def _safetensors_header(read: Callable[[int, int], bytes]) -> bytes:
    """The first 8 + N bytes of a remote .safetensors file: its length prefix and JSON header."""
    prefix = read(0, 8)
    return prefix + read(8, 8 + int.from_bytes(prefix, "little"))


def _stub_path(s: _Settings, ref: HubRef, commit: str, name: str) -> Path:
    """Where the header-only stub of a remote file goes, keyed by endpoint, repo and commit."""
    host = re.sub(r"[^\w.-]", "_", s.endpoint.split("://", 1)[-1])
    return _header_dir() / host / ref.repo_id.replace("/", "--") / commit / name


def _write_atomic(path: Path, data: bytes) -> Path:
    """Write `data` to `path` via a temporary file, so readers never see half a stub."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return path


def _download_kwargs(ref: HubRef, s: _Settings) -> dict:
    """Arguments every huggingface_hub download call here shares."""
    return dict(revision=ref.revision, cache_dir=s.cache_dir, endpoint=s.endpoint, etag_timeout=s.timeout)


def _prepare_gguf_online(ref: HubRef, s: _Settings, filename: str, size: int, commit: str) -> PreparedModel:
    """GGUF: the header through Range reads now; the whole file when fetch_weights is called."""
    from huggingface_hub import hf_hub_download, try_to_load_from_cache

    def fetch() -> str:
        with _hub_errors(ref, s):
            return hf_hub_download(ref.repo_id, filename, **_download_kwargs(ref, s))

    cached = try_to_load_from_cache(ref.repo_id, filename, cache_dir=s.cache_dir, revision=commit)
    if isinstance(cached, str):
        return PreparedModel(metadata_path=Path(cached), fetch_weights=fetch)
    stub = _stub_path(s, ref, commit, Path(filename).stem + ".header.gguf")
    if not stub.is_file():
        with _hub_errors(ref, s):
            header = _fetch_gguf_header(_range_reader(ref, s, filename, commit), size,
                                        f"{ref.repo_id}/{filename}")
        _write_atomic(stub, header)
    return PreparedModel(metadata_path=stub, fetch_weights=fetch)


def _prepare_hf_online(ref: HubRef, s: _Settings, names: list[str], commit: str) -> PreparedModel:
    """HF repo: metadata files now (plus a header stub for an unindexed single file), weights later."""
    from huggingface_hub import snapshot_download

    meta, weights = _hf_selection(ref.repo_id, names)
    wanted = [_exact(n) for n in meta + weights]

    def fetch() -> str:
        with _hub_errors(ref, s):
            return snapshot_download(ref.repo_id, allow_patterns=wanted, **_download_kwargs(ref, s))

    with _hub_errors(ref, s):
        meta_dir = Path(snapshot_download(ref.repo_id, allow_patterns=[_exact(n) for n in meta],
                                          **_download_kwargs(ref, s)))
    if any(n.endswith(".safetensors.index.json") for n in meta) or all((meta_dir / w).is_file() for w in weights):
        return PreparedModel(metadata_path=meta_dir, fetch_weights=fetch)
    # one unindexed model.safetensors: plan from a header-only copy beside links to the metadata
    stub_dir = _stub_path(s, ref, commit, "hf")
    for name in meta:
        link = stub_dir / name
        if not link.exists():
            stub_dir.mkdir(parents=True, exist_ok=True)
            link.unlink(missing_ok=True)
            link.symlink_to((meta_dir / name).resolve())
    for name in weights:
        if not (stub_dir / name).is_file():
            with _hub_errors(ref, s):
                header = _safetensors_header(_range_reader(ref, s, name, commit))
            _write_atomic(stub_dir / name, header)
    return PreparedModel(metadata_path=stub_dir, fetch_weights=fetch)


def _cached_snapshot(ref: HubRef, s: _Settings) -> Path:
    """The cached snapshot dir of the ref's revision, or a HubError saying it is not cached."""
    from huggingface_hub.file_download import REGEX_COMMIT_HASH, repo_folder_name

    storage = Path(s.cache_dir) / repo_folder_name(repo_id=ref.repo_id, repo_type="model")
    revision = ref.revision or "main"
    ref_file = storage / "refs" / revision
    commit = revision if REGEX_COMMIT_HASH.fullmatch(revision) else (
        ref_file.read_text().strip() if ref_file.is_file() else None)
    snapshot = storage / "snapshots" / commit if commit else None
    if snapshot is None or not snapshot.is_dir():
        raise HubError(f"repo {ref.repo_id!r} (revision {revision}) is not cached in {s.cache_dir} "
                       "and HF_HUB_OFFLINE=1 forbids downloading it; run once online, or pass a local path")
    return snapshot


def _snapshot_files(snapshot: Path) -> list[str]:
    """Relative paths of the files present in a cached snapshot (complete downloads only)."""
    return sorted(str(p.relative_to(snapshot)) for p in snapshot.rglob("*") if p.is_file())


def _prepare_offline(ref: HubRef, s: _Settings) -> PreparedModel:
    """HF_HUB_OFFLINE=1: the cached snapshot only, no network call; missing weights are an error."""
    snapshot = _cached_snapshot(ref, s)
    names = _snapshot_files(snapshot)
    wants_gguf = ref.gguf_file or ref.quant_tag or not any(n.endswith(".safetensors") for n in names)
    if wants_gguf:
        try:
            path = snapshot / _pick_gguf(ref, names)
        except ValueError as exc:
            raise HubError(f"offline (HF_HUB_OFFLINE=1) and the cache does not hold the GGUF asked for: {exc}") from None
        return PreparedModel(metadata_path=path, fetch_weights=lambda: str(path))
    meta, weights = _hf_selection(ref.repo_id, names)
    index = next((snapshot / n for n in meta if n.endswith(".safetensors.index.json")), None)
    needed = set(weights) | (set(json.loads(index.read_text())["weight_map"].values()) if index else set())
    missing = sorted(n for n in needed if not (snapshot / n).is_file())
    if missing:
        raise HubError(f"repo {ref.repo_id!r} is only partly cached in {s.cache_dir} (missing "
                       f"{', '.join(missing)}) and HF_HUB_OFFLINE=1 forbids downloading; run once online")
    return PreparedModel(metadata_path=snapshot, fetch_weights=lambda: str(snapshot))


def _prepare_modelscope(ref: HubRef) -> PreparedModel:
    """ModelScope: metadata first, then weights (GGUF: the whole file, so the plan runs after it)."""
    try:
        from modelscope import snapshot_download
    except ImportError:
        raise HubError("ModelScope was requested (PAGEDLLM_USE_MODELSCOPE / VLLM_USE_MODELSCOPE or "
                       "source='modelscope') but the modelscope package is not installed: "
                       "pip install modelscope") from None
    if ref.gguf_file or ref.quant_tag:
        pattern = _exact(ref.gguf_file) if ref.gguf_file else f"*{ref.quant_tag}*.gguf"
        root = Path(snapshot_download(ref.repo_id, revision=ref.revision, allow_patterns=[pattern]))
        path = root / _pick_gguf(ref, _snapshot_files(root))
        return PreparedModel(metadata_path=path, fetch_weights=lambda: str(path))
    meta = sorted(_META_FILES) + ["*.safetensors.index.json"]
    root = snapshot_download(ref.repo_id, revision=ref.revision, allow_patterns=meta)
    return PreparedModel(metadata_path=Path(root), fetch_weights=lambda: snapshot_download(
        ref.repo_id, revision=ref.revision, allow_patterns=meta + ["*.safetensors"]))


def prepare_hub_model(ref: HubRef, source: Optional[str] = None) -> PreparedModel:
    """Fetch what planning needs (config, index, tokenizer; or a GGUF header) and defer the weights."""
    if _use_modelscope(source):
        return _prepare_modelscope(ref)
    s = _settings()
    if s.offline:
        return _prepare_offline(ref, s)
    from huggingface_hub import HfApi

    with _hub_errors(ref, s):
        info = HfApi(endpoint=s.endpoint).model_info(ref.repo_id, revision=ref.revision,
                                                     files_metadata=True, timeout=s.timeout)
    sizes = {f.rfilename: f.size or 0 for f in info.siblings or []}
    names = sorted(sizes)
    has_safetensors = any(n.endswith(".safetensors") and "/" not in n for n in names)
    if ref.gguf_file or ref.quant_tag or (not has_safetensors and any(n.endswith(".gguf") for n in names)):
        filename = _pick_gguf(ref, names)
        return _prepare_gguf_online(ref, s, filename, sizes[filename], info.sha or "unknown")
    return _prepare_hf_online(ref, s, names, info.sha or "unknown")
