"""What the Hugging Face Hub cache holds, and removing one repo from it (through
huggingface_hub's own cache scanner and delete strategy, which knows its blobs and symlinks)."""
from __future__ import annotations

import dataclasses
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from pagedllm.hub.hub import hub_cache_dir
from pagedllm.paths import hub_headers_dir


@dataclass(frozen=True)
class CachedRepo:
    """One model repo in the Hub cache."""

    repo_id: str
    path: Path  # its folder, models--owner--name
    size: int  # bytes on disk
    formats: tuple[str, ...]  # "gguf" and/or "safetensors"; empty: metadata only
    revisions: tuple[str, ...]  # commit hashes of its snapshots


def _formats(repo) -> tuple[str, ...]:
    """The weight formats any snapshot of a scanned repo holds."""
    names = {f.file_name for rev in repo.revisions for f in rev.files}
    return tuple(fmt for fmt, ext in (("gguf", ".gguf"), ("safetensors", ".safetensors"))
                 if any(n.endswith(ext) for n in names))


def _scan(cache: Path) -> list:
    """huggingface_hub's scan of the cache's model repos; none if the cache does not exist."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir(cache)
    except CacheNotFound:
        return []
    return sorted((r for r in info.repos if r.repo_type == "model"), key=lambda r: r.repo_id)


def cached_repos() -> list[CachedRepo]:
    """The model repos in the Hub cache (HF_HUB_CACHE / HF_HOME), sorted by id."""
    return [CachedRepo(r.repo_id, Path(r.repo_path), r.size_on_disk, _formats(r),
                       tuple(sorted(rev.commit_hash for rev in r.revisions)))
            for r in _scan(hub_cache_dir())]


def remove_repo(repo_id: str) -> Optional[CachedRepo]:
    """Delete exactly the repo `repo_id` (case as cached) from the Hub cache, and pagedllm's
    header stubs of it; the repo removed, or None if the cache does not hold it."""
    from huggingface_hub import scan_cache_dir

    cache = hub_cache_dir()
    scanned = next((r for r in _scan(cache) if r.repo_id == repo_id), None)
    if scanned is None:
        return None
    removed = CachedRepo(scanned.repo_id, Path(scanned.repo_path), scanned.size_on_disk,
                         _formats(scanned), tuple(rev.commit_hash for rev in scanned.revisions))
    if removed.revisions:  # all revisions: the strategy drops the repo folder, shared blobs kept
        # the strategy matches commit hashes in every repo it was given: give it this one only
        # (two repos may share a commit, e.g. mirrors of one upload)
        info = dataclasses.replace(scan_cache_dir(cache), repos=frozenset({scanned}))
        info.delete_revisions(*removed.revisions).execute()
    # a repo with refs or blobs but no snapshot (an interrupted download) is only its folder
    shutil.rmtree(removed.path, ignore_errors=True)
    folder = removed.path.name
    shutil.rmtree(cache / ".locks" / folder, ignore_errors=True)
    for stubs in hub_headers_dir().glob(f"*/{repo_id.replace('/', '--')}"):
        shutil.rmtree(stubs, ignore_errors=True)
    return removed
