"""The refusal's text: what the model needs, what is available, and the ways out (advice.py),
the tested way first, then each weight format by its expected speed."""
from __future__ import annotations

from dataclasses import replace
from typing import Optional, Sequence

from pagedllm.memory.advice import (FAMILY_SIZES, TESTED, FormatWays, Way, all_format_ways,
                                    gguf_hub_ref, split_ways, tested_way, tp_sizes)
from pagedllm.memory.decode_speed import MESSAGE_SECONDS, WEIGHT_READ_BYTES_PER_S
from pagedllm.memory.footprint import ModelFootprint
from pagedllm.memory.plan import (DISK_READ_BYTES_PER_S, InsufficientMemoryError, PlanLimits,
                                  Shortfall)
from pagedllm.platforms.interface import MemoryInfo, fmt_bytes

SPLIT_HOW = ("a split runs one rank a machine: distributed_executor_backend='ray' over a Ray "
             "cluster (docs/ray_two_vms.md), or one rank per cgroup (PAGEDLLM_RANK_CGROUP); "
             "ranks on this one machine share its memory")


def rate(tok_per_s: float) -> str:
    """'~13 tok/s', '~4.6 tok/s', '~0.38 tok/s'."""
    digits = 0 if tok_per_s >= 10 else 1 if tok_per_s >= 1 else 2
    return f"~{tok_per_s:.{digits}f} tok/s"


def _hub_line(ref: Optional[str], pp: int) -> str:
    if ref is None:
        return ("; from the Hub, as repo:TAG (e.g. OWNER/NAME-GGUF:Q4_K_M), where this model's "
                "publisher has a GGUF repository")
    split = f" -pp {pp} --distributed-executor-backend ray" if pp > 1 else ""
    return f"; get it from the Hub: pagedllm serve {ref}{split}"


def _one_text(way: Way) -> str:
    mapped = (f", its blocks mapped from a file (the page cache holds ~{way.page_cache_share:.0%}"
              " of them)" if way.mapped else "")
    return f"fits on this machine{mapped}: {rate(way.tok_per_s)}"


def _tested_line(ways: Sequence[FormatWays], fp: ModelFootprint) -> Optional[str]:
    """The seed user's way, when it fits: a Q4_K_M GGUF on this machine, or over two."""
    way = tested_way(ways)
    if way is None:
        return None
    ref = gguf_hub_ref(fp.arch, TESTED)
    if way.machines == 1:
        return f"  - the tested way: a Q4_K_M GGUF, {_one_text(way)}{_hub_line(ref, 1)}"
    mapped = ", each mapping its blocks from a file" if way.mapped else ""
    return (f"  - the tested way: a Q4_K_M GGUF with pipeline_parallel_size=2 over two "
            f"machines like this one (one rank each{mapped}): {rate(way.tok_per_s)}"
            f"{_hub_line(ref, 2)}")


def _split_text(pp: Optional[Way], tp: Optional[Way], sizes: tuple[int, ...],
                fp: ModelFootprint) -> str:
    a = fp.arch
    parts = [f"pipeline_parallel_size={pp.pipeline_parallel_size} over "
             f"{pp.machines} machines like this one ({rate(pp.tok_per_s)})" if pp is not None
             else f"no pipeline_parallel_size up to its {a.num_hidden_layers} layers fits"]
    if tp is not None:
        parts.append(f"tensor_parallel_size={tp.tensor_parallel_size} over {tp.machines} "
                     f"machines like this one ({rate(tp.tok_per_s)})")
    else:
        options = ", ".join(map(str, sizes)) or "none"
        parts.append(f"no tensor_parallel_size that splits its {a.num_attention_heads} heads "
                     f"and {a.num_key_value_heads} KV heads ({options}) fits")
    return "; ".join(parts)


def _format_line(ways: FormatWays, fp: ModelFootprint) -> str:
    f = ways.fmt
    size = f"weights ~{fmt_bytes(ways.run_bytes)}"
    if f.at_load:
        size += (f" (made at load slice by slice, then regrouped: the load peaks near "
                 f"~{fmt_bytes(ways.load_bytes)})")
    where = (_one_text(ways.one) if ways.one is not None
             else _split_text(ways.pp, ways.tp, ways.tp_sizes, fp))
    ref = gguf_hub_ref(fp.arch, f.tag) if f.gguf else None
    how = f" ({f.how})" if f.how else ""
    return f"  - {f.label}{how}, {size}: {where}" + (f"; from the Hub: {ref}" if ref else "")


def _whole(fp: ModelFootprint) -> list[ModelFootprint]:
    """The whole model as this footprint's checkpoint holds it (of a rank's share: all of its
    layers), in the order the engine plans it: anonymous, then its GGUF blocks mapped."""
    a, layout = fp.arch, fp.layout
    total = layout.total if layout is not None else fp.weight_bytes + fp.mapped_bytes
    whole = replace(fp, weight_bytes=total, mapped_bytes=0, processes=1, num_layers=None,
                    load_extra_bytes=0, has_head=True, where="",
                    kv_bytes_per_token=fp.kv_bytes_per_token * a.num_hidden_layers
                    // max(1, fp.layers))
    if layout is None or not layout.mapped_total:
        return [whole]
    return [replace(whole, load_extra_bytes=layout.mapped_total),
            replace(whole, weight_bytes=total - layout.mapped_total,
                    mapped_bytes=layout.mapped_total)]


def advise(short: Shortfall) -> InsufficientMemoryError:
    """The planner's refusal with the ways out: the tested way first, then each weight format
    by speed, the checkpoint's own split, a shorter max_model_len, a smaller model."""
    fp, mem, budget = short.fp, short.mem, short.budget
    lines = [short.text(), (
        f"ways out: the tested way first, then by speed (one-stream decode as the planner's "
        f"bandwidth model expects it, weights read at {WEIGHT_READ_BYTES_PER_S / 1e9:.0f} GB/s, "
        f"what the page cache lacks of mapped blocks at {DISK_READ_BYTES_PER_S / 1e6:.0f} MB/s, "
        f"{MESSAGE_SECONDS * 1e3:.1f} ms a message between ranks; a machine like this one: "
        f"{fmt_bytes(budget)} planned)")]
    # each way planned as the engine would plan it, for one sequence of the length it needs
    limits = PlanLimits(short.limits.block_size, short.limits.max_num_seqs,
                        short.limits.max_num_batched_tokens,
                        max_model_len=min(short.need_len, fp.max_len_supported),
                        overhead_bytes=short.overhead_bytes // fp.processes)
    ways = all_format_ways(fp.arch, fp.num_params, fp.source, mem, limits)
    line = _tested_line(ways, fp)
    if line is not None:
        lines.append(line)
    ranked = sorted(ways, key=lambda w: -w.best.tok_per_s if w.best else 0.0)
    lines += [_format_line(w, fp) for w in ranked]
    pp, tp = _own_split(fp, mem, limits, lines)
    lines += _shorter_len(short)
    if any(w.pp or w.tp for w in ways) or pp or tp:
        lines.append(f"  ({SPLIT_HOW})")
    lines += _smaller_model(short)
    machines = {"pipeline_parallel_size": pp.pipeline_parallel_size if pp else None,
                "tensor_parallel_size": tp.tensor_parallel_size if tp else None}
    return InsufficientMemoryError("\n".join(lines), machines, short.page_cache, tuple(ways),
                                   short)


def _own_split(fp: ModelFootprint, mem: MemoryInfo, limits: PlanLimits,
               lines: list[str]) -> tuple[Optional[Way], Optional[Way]]:
    """The fewest pipeline and tensor parallel ranks the checkpoint as it is needs; a GGUF at
    hand (its own blocks, not the estimate's) gets a line of its own in `lines`."""
    whole = _whole(fp)
    own = whole[0].layout
    if own is None:
        return None, None
    pp, tp = split_ways("as is", whole, own, mem, limits, tp_sizes(
        fp.arch, own.mlp_block if own.mapped_total else 1))
    if own.mapped_total:
        lines.append("  - this GGUF as it is: " + _split_text(pp, tp, tp_sizes(
            fp.arch, own.mlp_block), fp))
    return pp, tp


def _shorter_len(short: Shortfall) -> list[str]:
    """A shorter max_model_len that fits, if the weights leave room for any KV cache."""
    fp = short.fp
    room = short.budget - short.overhead_bytes - short.activation_bytes - fp.weight_bytes
    if room <= 0:
        return []
    block = short.limits.block_size
    fit_len = room // fp.kv_bytes_per_token // block * block
    return [f"  - a shorter max_model_len: {fit_len} tokens fit "
            f"(KV {fmt_bytes(fp.kv_bytes_per_token)} per token)"]


def _smaller_model(short: Shortfall) -> list[str]:
    """The largest smaller model of the same family whose weights, in fp's bytes a parameter,
    fit beside the runtime and workspace (the whole model's advice only)."""
    fp = short.fp
    room = short.budget - short.overhead_bytes - short.activation_bytes
    itemsize = fp.weight_bytes / max(1, fp.num_params)
    smaller = [(name, p) for name, p in FAMILY_SIZES.get(fp.arch.architecture, [])
               if p * itemsize < room and p < fp.num_params and fp.num_layers is None]
    if not smaller:
        return []
    name, p = smaller[-1]
    return [f"  - a smaller model of the same family: {name} (~{fmt_bytes(p * itemsize)} "
            f"in {fp.dtype_name})"]
