"""The runner's LoRA adapters: max_loras slots on the model's projections, least recently used
evicted, over an LRU cache of max_cpu_loras adapters read from disk.

The projections are wrapped at load (after the captured decode step took the base modules,
before it takes the wrappers' slot tensors): each q/k/v/o/gate/up/down of a decoder layer,
merged q/k/v and gate/up by shard. A step's
requests map to slots; their token rows, grouped by slot, are what LoRALinear adds deltas to.
The scheduler admits at most max_loras distinct adapters at once, so a slot to evict (one
this step does not use) always exists.

Under tensor parallelism A and B are split as their base is (the model's checkpoint_shards,
models/tensor_parallel.py), in the slots and in the read copies alike:

    column-parallel (q/k/v, gate/up): B's rows of the rank's output rows, A whole
    row-parallel (o_proj, down_proj): A's columns of the rank's input columns, B whole; the
        wrapper sits inside the all-reduce (ReducedOutput.inner), so the ranks' partial
        deltas are summed with the base's partial outputs in the one all-reduce

A pipeline stage wraps, and keeps the adapters' matrices of, the layers it holds.
"""
from __future__ import annotations

import dataclasses
import logging
import re
from collections import OrderedDict
from typing import Mapping, Sequence

import torch
from torch import nn

from pagedllm.config import LoRAConfig, ModelArchConfig
from pagedllm.layers.ggml_linear import GGMLLinear, GGMLMergedLinear
from pagedllm.layers.linear import MergedLinear
from pagedllm.layers.lora import LoRAGroup, LoRALinear
from pagedllm.loader.lora_adapter import load_adapter
from pagedllm.lora.peft import ATTENTION_MODULES, SUPPORTED_MODULES, LoRAAdapter
from pagedllm.lora.request import LoRARequest
from pagedllm.shard import Shard
from pagedllm.worker.input_batch import ScheduledSeq

logger = logging.getLogger("pagedllm")

# a projection, or (tensor parallel) the row-parallel one inside its all-reduce wrapper
_PATH = re.compile(r"model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)(?:\.inner)?")
Target = tuple[int, str]  # (layer index, projection name), as the adapter's tensors name them


def _shards(module: nn.Module, name: str) -> tuple[int, tuple[str, ...], tuple[int, ...]]:
    """(in_features, shard names, shard sizes) of a projection module, or (0, (), ())."""
    if isinstance(module, (MergedLinear, GGMLMergedLinear)):
        return module.in_features, module.shard_names, module.output_sizes
    if isinstance(module, (nn.Linear, GGMLLinear)):
        return module.in_features, (name,), (module.out_features,)
    return 0, (), ()


def wrap_projections(model: nn.Module, config: LoRAConfig, device: torch.device
                     ) -> dict[Target, tuple[LoRALinear, int]]:
    """Swap each decoder projection LoRA may target for a LoRALinear over it; (layer,
    projection) -> (its wrapper, its shard there)."""
    targets: dict[Target, tuple[LoRALinear, int]] = {}
    for path, module in list(model.named_modules()):
        m = _PATH.fullmatch(path)
        if m is None:
            continue
        in_features, names, sizes = _shards(module, m[3])
        if not names or not set(names) <= set(SUPPORTED_MODULES):
            continue  # a router, a MoE block: not a projection LoRA applies to
        wrapper = LoRALinear(module, in_features, sizes, config.max_loras, config.max_lora_rank,
                             device)
        parent, _, attr = path.rpartition(".")
        setattr(model.get_submodule(parent), attr, wrapper)
        for shard, name in enumerate(names):
            targets[(int(m[1]), name)] = (wrapper, shard)
    return targets


class LoRASlots:
    """Which adapter sits in which slot, and the step's token groups."""

    def __init__(self, model: nn.Module, arch: ModelArchConfig, config: LoRAConfig,
                 device: torch.device) -> None:
        self.arch, self.config, self.device = arch, config, device
        # the part of each checkpoint tensor this tensor-parallel rank holds (none: all whole)
        self.shards: Mapping[str, Shard] = getattr(model, "checkpoint_shards", {})
        self.targets = wrap_projections(model, config, device)
        self.layers = {layer for layer, _ in self.targets}  # a pipeline stage's: not all
        self.wrappers = list({id(w): w for w, _ in self.targets.values()}.values())
        self.slots: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, LRU first
        self.read: OrderedDict[int, LoRAAdapter] = OrderedDict()  # adapter id -> weights, LRU

    def groups(self, seqs: Sequence[ScheduledSeq]) -> tuple[LoRAGroup, ...]:
        """The step's token rows per slot, loading the adapters it needs into slots."""
        needed = {s.state.lora_request.lora_int_id for s in seqs
                  if s.state.lora_request is not None}
        rows: dict[int, list[torch.Tensor]] = {}
        for seq in seqs:
            request = seq.state.lora_request
            if request is None:
                continue
            slot = self._slot(request, needed)
            rows.setdefault(slot, []).append(torch.arange(seq.start, seq.start + seq.num_tokens))
        return tuple(LoRAGroup(slot, torch.cat(parts).to(self.device))
                     for slot, parts in rows.items())

    def _slot(self, request: LoRARequest, needed: set[int]) -> int:
        """The adapter's slot, loading it into a free one or the least recently used one this
        step does not need."""
        lora_id = request.lora_int_id
        if lora_id in self.slots:
            self.slots.move_to_end(lora_id)
            return self.slots[lora_id]
        free = sorted(set(range(self.config.max_loras)) - set(self.slots.values()))
        if free:
            slot = free[0]
        else:
            victim = next((i for i in self.slots if i not in needed), None)
            if victim is None:
                raise RuntimeError(f"the step uses more than max_loras={self.config.max_loras} "
                                   "adapters (the scheduler should have kept it within)")
            slot = self.slots.pop(victim)
            logger.debug("LoRA adapter %d evicted from slot %d", victim, slot)
        self._load(slot, self._adapter(request))
        self.slots[lora_id] = slot
        return slot

    def _adapter(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter's weights, read from disk unless cached (max_cpu_loras kept)."""
        lora_id = request.lora_int_id
        if lora_id in self.read:
            self.read.move_to_end(lora_id)
            return self.read[lora_id]
        adapter = self._rank_part(load_adapter(request, self.arch, self.config.max_lora_rank))
        self.read[lora_id] = adapter
        while len(self.read) > self.config.cpu_loras:
            self.read.popitem(last=False)
        return adapter

    def _load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Put an adapter's matrices into a slot of every wrapper (the others' shards cleared)."""
        for wrapper in self.wrappers:
            wrapper.clear_slot(slot)
        for target, (a, b) in adapter.weights.items():
            if target not in self.targets:
                raise RuntimeError(f"LoRA adapter {adapter.request.lora_name!r}: layer "
                                   f"{target[0]}'s {target[1]} is not a projection of this model")
            wrapper, shard = self.targets[target]
            wrapper.set_slot(slot, shard, a, b, adapter.config.scale)

    def _rank_part(self, adapter: LoRAAdapter) -> LoRAAdapter:
        """The part of an adapter this rank keeps (the memory plan counts no more): the layers
        its pipeline stage holds, and of each, under tensor parallelism, B's rows where the
        base's output rows are split, A's columns where its input columns are."""
        weights = {}
        for (layer, module), (a, b) in adapter.weights.items():
            if layer not in self.layers:
                continue  # another pipeline stage's layer
            block = "self_attn" if module in ATTENTION_MODULES else "mlp"
            part = self.shards.get(f"model.layers.{layer}.{block}.{module}.weight")
            if part is not None and part.axis == 0:
                b = b[part.start:part.stop].clone()
            elif part is not None:
                a = a[:, part.start:part.stop].clone()
            weights[(layer, module)] = (a, b)
        return dataclasses.replace(adapter, weights=weights)
