"""How a checkpoint pools: its sentence-transformers files (modules.json, the Pooling module's
config.json, a Normalize module), or vLLM's default for the architecture when it has none."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from pagedllm.config import PoolerConfig
from pagedllm.loader.errors import ModelFileError, read_json_object

_ST = "sentence_transformers.models."
_TRANSFORMER, _POOLING, _NORMALIZE = _ST + "Transformer", _ST + "Pooling", _ST + "Normalize"
# 1_Pooling/config.json switch -> pooling_type
_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
          "pooling_mode_lasttoken": "last"}
_UNSUPPORTED_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                      "pooling_mode_weightedmean_tokens")
# sentence-transformers >= 3 may write the mode by name ("pooling_mode": "mean")
_NAMED_MODES = {"cls": "cls", "mean": "mean", "lasttoken": "last"}
# vLLM's BertEmbeddingModel without sentence-transformers files: CLS token, normalised
DEFAULT_POOLER = PoolerConfig("cls", normalize=True)


def _pooling_type(cfg: dict[str, Any], source: Path) -> str:
    """The one pooling mode a Pooling config turns on; ModelFileError naming any other."""
    named = cfg.get("pooling_mode")
    if isinstance(named, str):
        if named not in _NAMED_MODES:
            raise ModelFileError(f"pooling_mode={named!r} is not supported; supported: "
                                 f"{', '.join(_NAMED_MODES)} in {source}")
        return _NAMED_MODES[named]
    for key in _UNSUPPORTED_MODES:
        if cfg.get(key):
            raise ModelFileError(f"{key} is not supported (cls, mean and last-token pooling "
                                 f"are) in {source}")
    on = [mode for key, mode in _MODES.items() if cfg.get(key)]
    if len(on) != 1:
        raise ModelFileError(f"exactly one of {', '.join(_MODES)} must be true, got "
                             f"{len(on)} in {source}")
    if cfg.get("include_prompt", True) is not True:
        raise ModelFileError(f"include_prompt=false (pooling without the prompt's tokens) is "
                             f"not supported in {source}")
    return on[0]


def _modules(root: Path) -> Optional[list[dict[str, Any]]]:
    """modules.json's entries, or None when the checkpoint has none."""
    file = root / "modules.json"
    if not file.is_file():
        return None
    try:
        modules = json.loads(file.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ModelFileError(f"{file} is not valid JSON ({err})") from None
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ModelFileError(f"{file} must hold a list of module objects")
    return modules


def pooler_config(root: Path, default: PoolerConfig = DEFAULT_POOLER) -> PoolerConfig:
    """The checkpoint directory's pooling as its sentence-transformers files say; `default`
    when it has no modules.json. A module it lists that is not run (Dense, ...) is refused."""
    modules = _modules(root)
    if modules is None:
        return default
    source = root / "modules.json"
    pooling: Optional[str] = None
    normalize = False
    for module in modules:
        kind = module.get("type")
        if kind == _TRANSFORMER:
            continue
        if kind == _POOLING:
            folder = root / str(module.get("path", ""))
            pooling = _pooling_type(read_json_object(folder / "config.json"),
                                    folder / "config.json")
        elif kind == _NORMALIZE:
            normalize = True
        else:
            raise ModelFileError(f"module type {kind!r} is not supported (Transformer, Pooling "
                                 f"and Normalize are) in {source}")
    if pooling is None:
        raise ModelFileError(f"{source} lists no {_POOLING} module")
    return PoolerConfig(pooling, normalize)


def input_type_prompts(model_path: str | Path) -> dict[str, str]:
    """The prompts an embedding request's input_type names (Cohere's /v2/embed, as vLLM
    serves it): config.json's task_instructions, else config_sentence_transformers.json's
    prompts, each a prefix put before the text; their string entries only. {} when the
    checkpoint (or the folder of a GGUF) names none. default_prompt_name is not read: vLLM
    applies no prompt by default."""
    path = Path(model_path)
    root = path if path.is_dir() else path.parent
    for file, key in (("config.json", "task_instructions"),
                      ("config_sentence_transformers.json", "prompts")):
        if (root / file).is_file():
            found = read_json_object(root / file).get(key)
            prompts = ({k: v for k, v in found.items() if isinstance(v, str)}
                       if isinstance(found, dict) else {})
            if prompts:
                return prompts
    return {}
