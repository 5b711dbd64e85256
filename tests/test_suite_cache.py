"""The suite writes its exports to its own cache, never to the user's model cache."""
from __future__ import annotations

import os
from pathlib import Path


def test_hf_exports_live_in_the_suite_cache(smollm_hf_dir: Path, suite_cache: Path):
    if "PAGEDLLM_TEST_CACHE" not in os.environ:
        assert suite_cache == Path.home() / ".cache" / "pagedllm-tests"
    assert smollm_hf_dir.parent == suite_cache / "hf"
    assert (smollm_hf_dir / "config.json").is_file()
