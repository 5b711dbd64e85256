"""`pagedllm doctor [MODEL]`: what this machine is, and whether and how a model fits — metadata only."""
from __future__ import annotations

import json
import platform as _platform
import sys
import time
from typing import Any, Optional

import torch

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.entrypoints.torch_build import cuda_build_warning, torch_build_facts
from pagedllm.platforms import cpu_platform, resolve_platform
from pagedllm.platforms.gpu import list_gpus
from pagedllm.platforms.interface import fmt_bytes


def platform_report(device: Optional[str] = None) -> dict[str, Any]:
    """Probes, torch build, CPU, memory and the chosen platform."""
    choice = resolve_platform(device)
    cpu = cpu_platform()
    return {
        "python": sys.version.split()[0], "os": _platform.platform(),
        "torch": {"version": torch.__version__, "cuda": torch.version.cuda,
                  "hip": getattr(torch.version, "hip", None),
                  "cuda_build_warning": cuda_build_warning(torch_build_facts())},
        "probes": [{"platform": p.platform, "usable": p.usable, "detail": p.detail}
                   for p in choice.probes],
        "chosen": {"platform": choice.platform.name, "requested": choice.requested,
                   "source": choice.source},
        "cpu": cpu.describe()["cpu"], "memory": cpu.describe()["memory"],
        "platform": choice.platform.describe(), "gpus": list_gpus(), "kernels": kernel_report(),
    }


def kernel_report() -> dict[str, Any]:
    """Which instruction-set variant the kept-block (x8) matmuls run and why; from a build
    already in the cache only (the doctor never compiles)."""
    from pagedllm import kernels

    if not kernels.kernels_built():
        return {"isa": None, "reason": "the CPU kernels are not built yet "
                                       "(python -m pagedllm.kernels builds them)"}
    try:
        isa = kernels.kernel_isa()
    except (kernels.KernelBuildError, ValueError) as err:
        return {"isa": None, "reason": str(err)}
    return {"isa": isa.name, "reason": isa.reason, "runnable": list(isa.runnable)}


def model_report(model: str, device: Optional[str] = None, dtype: str = "auto",
                 max_model_len: Optional[int] = None,
                 speculative_config: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """Whether MODEL fits here and with which sizes, from its metadata; with a draft model
    (speculative_config method "draft_model"), whether the draft fits beside it too."""
    from pagedllm.engine.config_builder import (engine_dtype, kv_cache_torch_dtype,
                                                plan_engine_memory, resolve_quantization)
    from pagedllm.loader.checkpoint import resolve_checkpoint
    from pagedllm.loader.metadata import checkpoint_num_params
    from pagedllm.hub.sources import locate_model
    from pagedllm.memory.advice import fastest_way, tested_way
    from pagedllm.memory.footprint import kv_bytes_per_token
    from pagedllm.memory.plan import InsufficientMemoryError

    ckpt = resolve_checkpoint(locate_model(model).metadata_path)  # metadata only, no weights
    choice = resolve_platform(device)
    args = EngineArgs(model=model, dtype=dtype, device=device or "auto",
                      max_model_len=max_model_len, speculative_config=speculative_config)
    num_params, source = checkpoint_num_params(ckpt)
    out: dict[str, Any] = {"model": model, "path": str(ckpt.path), "format": ckpt.kind,
                           "architecture": ckpt.arch.architecture, "parameters": num_params,
                           "parameters_source": source,
                           "max_position_embeddings": ckpt.arch.max_position_embeddings}
    quantization = resolve_quantization(args, ckpt, choice.platform, build_kernels=False)
    out["quantization"] = quantization
    chosen = engine_dtype(dtype, ckpt.arch.torch_dtype, choice.platform, quantization)
    try:
        plan, chosen = plan_engine_memory(args, ckpt, choice.platform, chosen, quantization)
    except InsufficientMemoryError as err:
        offline = offline_alternative(model, num_params, device, max_model_len)
        # how many machines like this one would hold it split (also in the reason's ways out),
        # and every weight format's ways, fastest first, with the planner's expected tok/s
        out.update(fits=False, dtype=str(chosen).removeprefix("torch."), offline_model=offline,
                   machines_needed=err.machines, ways_out=ways_report(err.ways),
                   tested_way=_way_dict(tested_way(err.ways)),
                   fastest_way=_way_dict(fastest_way(err.ways)),
                   reason=str(err) if offline is None else _with_way_out(
                       str(err), f"  - a model already on this machine (no download): "
                       f"{offline} (pagedllm serve {offline})"))
        return out
    # the cache's dtype, as the engine will keep it (bf16 under bf16 matrices on the CPU)
    kv_dtype = kv_cache_torch_dtype(args.kv_cache_dtype, chosen, choice.platform, quantization)
    per_token = kv_bytes_per_token(ckpt.arch, torch.empty((), dtype=kv_dtype).element_size())
    out.update(fits=True, dtype=str(chosen).removeprefix("torch."),
               weight_bytes=plan.weight_bytes, mapped_bytes=plan.mapped_bytes,
               kv_bytes_per_token=per_token,
               kv_cache_bytes=plan.kv_cache_bytes, max_model_len=plan.max_model_len,
               sequences_at_max_model_len=plan.num_blocks * plan.block_size // plan.max_model_len,
               plan=plan.summary())
    spec = args.speculative()
    if spec is not None and spec.uses_draft_model:
        out["draft"] = draft_report(args, ckpt, choice.platform, chosen, quantization,
                                    plan.weight_bytes + plan.mapped_bytes)
    return out


def draft_report(args: EngineArgs, ckpt: Any, platform: Any, dtype: torch.dtype,
                 quantization: str, target_weight_bytes: int) -> dict[str, Any]:
    """Whether speculative_config's draft model fits beside the model (its weights, and its
    KV cache in every block), and the share of a target step's weight bytes a draft token
    reads: what a drafted token costs."""
    from pagedllm.engine.config_builder import plan_draft, plan_engine_memory
    from pagedllm.hub.sources import locate_model
    from pagedllm.loader.checkpoint import resolve_checkpoint
    from pagedllm.memory.plan import InsufficientMemoryError

    spec = args.speculative()
    draft_ckpt = resolve_checkpoint(locate_model(spec.model, spec.revision).metadata_path)
    draft = plan_draft(args, draft_ckpt, platform)
    fp = draft.footprint
    out: dict[str, Any] = {
        "model": spec.model, "architecture": draft_ckpt.arch.architecture,
        "dtype": str(draft.dtype).removeprefix("torch."), "quantization": draft.quantization,
        "weight_bytes": fp.weight_bytes, "kv_bytes_per_token": fp.kv_bytes_per_token,
        "bytes_per_token_vs_target": round(fp.weight_bytes / max(1, target_weight_bytes), 3)}
    try:
        plan, _ = plan_engine_memory(args, ckpt, platform, dtype, quantization, draft=fp)
    except InsufficientMemoryError as err:
        out.update(fits=False, reason=str(err))
        return out
    out.update(fits=True, kv_cache_bytes=plan.kv_cache_bytes, max_model_len=plan.max_model_len,
               sequences_at_max_model_len=plan.num_blocks * plan.block_size // plan.max_model_len,
               plan=plan.summary())
    return out


def _way_dict(way) -> Optional[dict[str, Any]]:
    return None if way is None else way.as_dict()


def ways_report(ways: tuple) -> list[dict[str, Any]]:
    """Each weight format's ways out (advice.FormatWays), fastest first: on one machine like
    this one, or the fewest pipeline / tensor parallel ranks, each with its expected tok/s."""
    ranked = sorted(ways, key=lambda w: -w.best.tok_per_s if w.best else 0.0)
    return [{"format": w.fmt.name, "label": w.fmt.label, "weight_bytes": w.run_bytes,
             "planned_bytes": w.load_bytes,
             **{k: None if v is None else v.as_dict()
                for k, v in (("one_machine", w.one), ("pipeline", w.pp), ("tensor", w.tp))}}
            for w in ranked]


def offline_alternative(model: str, num_params: int, device: Optional[str],
                        max_model_len: Optional[int]) -> Optional[str]:
    """The largest cached shipped model, smaller than `model`, that fits here: it needs neither
    the Hub nor a download."""
    from pagedllm.hub.model_store import cached_models, model_spec

    asked = model_spec(model)
    fitting = []
    for name in cached_models():
        if asked is not None and asked.name == name:
            continue
        report = model_report(name, device, "auto", max_model_len)
        if report["fits"] and report["parameters"] < num_params:
            fitting.append((report["parameters"], name))
    return max(fitting)[1] if fitting else None


def _with_way_out(reason: str, line: str) -> str:
    """The planner's refusal with `line` among its ways out, before the advice of a smaller
    model of the same family (which needs the Hub)."""
    lines = reason.split("\n")
    at = next((i for i, text in enumerate(lines) if text.startswith("  - a smaller model")),
              len(lines))
    return "\n".join(lines[:at] + [line] + lines[at:])


def _kernel_line(k: dict[str, Any]) -> str:
    if k["isa"] is None:
        return f"kept-block matmuls: {k['reason']}"
    return (f"kept-block matmuls: {k['isa']} kernels ({k['reason']}); this CPU runs "
            f"{', '.join(k['runnable'])}; PAGEDLLM_KERNEL_ISA forces one")


def format_text(report: dict[str, Any]) -> str:
    """The human-readable doctor report."""
    lines = [f"pagedllm doctor — Python {report['python']}, {report['os']}",
             f"torch {report['torch']['version']} (CUDA build: {report['torch']['cuda'] or 'no'}"
             f", HIP build: {report['torch']['hip'] or 'no'})"]
    if report["torch"].get("cuda_build_warning"):
        lines.append(f"  warning: {report['torch']['cuda_build_warning']}")
    lines.append("device probes:")
    for p in report["probes"]:
        lines.append(f"  {p['platform']:5} {'usable    ' if p['usable'] else 'not usable'}  "
                     f"{p['detail']}")
    ch = report["chosen"]
    lines.append(f"chosen device: {ch['platform']} ({ch['source']}: {ch['requested']})")
    cpu = report["cpu"]
    lines += [f"CPU: {cpu['model']}; ISA: {', '.join(cpu['features']) or 'baseline'}; "
              f"native bf16: {'yes' if cpu['native_bf16'] else 'no'}",
              _kernel_line(report["kernels"]),
              f"threads: {cpu['threads']} ({cpu['threads_source']})",
              f"memory: {fmt_bytes(report['memory']['available_bytes'])} usable "
              f"({report['memory']['source']})"]
    for g in report["gpus"]:
        lines.append(f"GPU {g['index']}: {g['name']}, {fmt_bytes(g['free_bytes'])} free of "
                     f"{fmt_bytes(g['total_bytes'])}")
    m = report.get("model_report")
    if m:
        lines.append(f"model {m['model']}: {m['architecture']}, {m['format']}, "
                     f"{m['parameters'] / 1e9:.2f} B parameters ({m['parameters_source']})")
        if m["fits"]:
            quant = "" if m.get("quantization", "none") == "none" else \
                f", quantization {m['quantization']}"
            mapped = (f" + {fmt_bytes(m['mapped_bytes'])} of blocks mapped from a file"
                      if m.get("mapped_bytes") else "")
            lines += [f"  fits: yes, dtype {m['dtype']}{quant}: weights {fmt_bytes(m['weight_bytes'])}"
                      f"{mapped}, KV {fmt_bytes(m['kv_bytes_per_token'])} per token",
                      f"  {m['sequences_at_max_model_len']} sequence(s) of max_model_len "
                      f"{m['max_model_len']} fit in a {fmt_bytes(m['kv_cache_bytes'])} KV cache"]
        else:
            lines.append("  fits: no — " + m["reason"].replace("\n", "\n  "))
        if m.get("draft"):
            lines += _draft_lines(m["draft"])
    return "\n".join(lines)


def _draft_lines(d: dict[str, Any]) -> list[str]:
    head = (f"draft model {d['model']}: {d['architecture']}, dtype {d['dtype']}, quantization "
            f"{d['quantization']}: weights {fmt_bytes(d['weight_bytes'])} "
            f"({100 * d['bytes_per_token_vs_target']:.0f}% of the model's bytes a token), KV "
            f"{fmt_bytes(d['kv_bytes_per_token'])} per token")
    if d["fits"]:
        return [head, f"  fits beside the model: yes; {d['sequences_at_max_model_len']} "
                      f"sequence(s) of max_model_len {d['max_model_len']} fit in a "
                      f"{fmt_bytes(d['kv_cache_bytes'])} KV cache holding both models' keys"]
    return [head, "  fits beside the model: no — " + d["reason"].replace("\n", "\n  ")]


def run(model: Optional[str], as_json: bool, device: Optional[str], dtype: str,
        max_model_len: Optional[int], speculative_config: Optional[dict] = None) -> int:
    """Print the report; exit status 0 when the model (if any) fits, and its draft model (if
    asked) beside it, 1 when not."""
    started = time.monotonic()
    report = platform_report(device)
    if model:
        report["model_report"] = model_report(model, device, dtype, max_model_len,
                                              speculative_config)
    report["seconds"] = round(time.monotonic() - started, 3)
    print(json.dumps(report, indent=2) if as_json else format_text(report))
    m = report.get("model_report")
    return 0 if m is None or (m["fits"] and m.get("draft", {}).get("fits", True)) else 1
