"""ModelRunner: SchedulerOutput in, one forward pass over all scheduled tokens, ModelRunnerOutput out.

It owns the model (load_model), the KV cache (initialize_kv_cache), the per-request state, the
persistent input buffers, the attention backend's metadata builder, the sampler, and the
captured decode step that replaces the model's layer loop for decode-only steps where it can.

As a pipeline stage (pipeline_parallel_size > 1) it holds its layers and their KV cache only;
a stage after the first takes the residual stream from the one before, a stage before the last
hands it on and returns an empty output: only the last stage samples. Every stage keeps the
same per-request state, the executor giving the others the tokens the last one sampled.

As a tensor parallel rank it holds its share of every layer and its KV heads' cache; every
rank runs every step (the collectives join them), the logits are gathered on all of them, and
rank 0 samples, the others taking its tokens as a pipeline stage does.

Both at once (tensor_parallel_size x pipeline_parallel_size ranks), it holds its TP share of
its stage's layers; the last stage's TP ranks gather the logits over their TP group, and its
TP rank 0 samples.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from typing import Optional

import torch
from torch import nn

from pagedllm.attention.metadata import AttentionMetadata, set_forward_context
from pagedllm.config import EngineConfig
from pagedllm.core.outputs import ModelRunnerOutput, TokenLogprobs
from pagedllm.core.sched_output import GrammarBitmask, SchedulerOutput
from pagedllm.distributed.stage import PipelineStage
from pagedllm.distributed.tensor_parallel import TensorParallelRank
from pagedllm.layers.attention import bind_kv_cache
from pagedllm.layers.custom_op import attn_backend_for, build_context
from pagedllm.layers.head_screen import HeadScreen
from pagedllm.layers.lora import LoRAGroup, set_lora_groups, step_lora_slots
from pagedllm.layers.pooler import Pooler
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.rejection import verify_point_mass
from pagedllm.sample.sampler import LogprobsTensors, Sampler, compute_prompt_logprobs
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output.bitmask import allocate_bitmask
from pagedllm.worker.captured_decode import CapturedDecode, decide
from pagedllm.worker.draft_runner import DraftJob, DraftRunner
from pagedllm.worker.input_batch import (CachedRequestState, InputBuffers, StepInputs,
                                         build_step_inputs)
from pagedllm.worker.kv_cache import allocate_kv_cache, kv_block_bytes
from pagedllm.worker.lora_slots import LoRASlots
from pagedllm.worker.model_loader import load_model
from pagedllm.worker.stage_comm import recv_from_prev, send_to_next

logger = logging.getLogger("pagedllm")

PROMPT_LOGPROBS_ROWS = 32  # prompt positions whose logits exist at once (19 MB for 152k ids)


class ModelRunner:
    """Keeps per-request state, builds step inputs, runs the model and the sampler."""

    def __init__(self, config: EngineConfig, stage: Optional[PipelineStage] = None,
                 tp: Optional[TensorParallelRank] = None) -> None:
        """stage: this runner's pipeline stage, or None: the whole model; tp: its tensor
        parallel rank, or None."""
        self.config = config
        self.stage = stage
        self.tp = tp
        self.platform = config.platform
        self.device = self.platform.device()
        self.block_size = config.cache.block_size
        self.eos_token_ids = list(config.eos_token_ids)
        self.vocab_size = config.arch.vocab_size
        self.model: Optional[nn.Module] = None
        self.kv_cache: Optional[torch.Tensor] = None
        self.captured_decode: Optional[CapturedDecode] = None
        self.decode_path = "not loaded"  # what runs decode-only steps, and why (one line)
        self.attn_builder = attn_backend_for(self.platform, config.dtype).builder_cls(self.block_size)
        self.sampler = Sampler(cpu_ops=self.platform.op_impl(torch.float32) == "cpu")
        sched = config.scheduler
        self.buffers = InputBuffers(max(sched.max_num_batched_tokens, sched.max_num_seqs),
                                    sched.max_num_seqs, -(-sched.max_model_len // self.block_size),
                                    self.device)
        self.requests: dict[str, CachedRequestState] = {}
        # a pooling runner pools each whole sequence and never samples (made at load_model:
        # a classification head is the model's)
        self.pooler: Optional[Pooler] = None
        self.lora: Optional[LoRASlots] = None  # enable_lora: the adapters' slots (load_model)
        self._told_lora_decode = False  # the log said once that LoRA steps skip the C++ stack
        self._stack_lora = False  # the captured decode step applies LoRA (take_lora)
        # greedy rows' tokens without the head's logits (layers/head_screen.py), when planned
        self.head_screen: Optional[HeadScreen] = None
        # speculative method "draft_model": proposes drafts after each step
        self.drafter = None if config.draft is None else DraftRunner(
            config.draft, self.vocab_size, self.buffers)

    def load_model(self) -> None:
        """Build and load the model; capture its decode step where the platform can."""
        self.model = load_model(self.config, self.stage, self.tp)
        if self.config.pooler is not None:
            head = self.config.arch.classifier
            self.pooler = Pooler(self.config.pooler, None if head is None else self.model.classify,
                                 head)
            self.captured_decode, self.decode_path = None, (
                "none (a pooling model: each request is one whole-sequence step)")
            return
        if self.tp is not None:  # the C++ stack has no all-reduce between its layers
            self.captured_decode, self.decode_path = None, (
                f"the model's layer loop (tensor parallel rank {self.tp.rank} of "
                f"{self.tp.world_size}: the C++ decode stack has no all-reduce between layers)")
        else:
            self.captured_decode, self.decode_path = decide(self.model, self.platform.kernels_ready)
        if self.drafter is not None:
            self.drafter.load_model()
            self.decode_path += f"; the draft model's: {self.drafter.decode_path}"
        if self.config.lora is not None:  # after the capture: it takes the base modules
            with build_context(self.platform, self.config.dtype):  # LoRALinear's C++ op or not
                self.lora = LoRASlots(self.model, self.config.arch, self.config.lora,
                                      self.device)
            self._stack_lora = (self.captured_decode is not None
                                and self.captured_decode.take_lora())
        if self.config.head_screen:
            screen = HeadScreen.build(getattr(self.model, "greedy_head", lambda: None)())
            if screen is None:
                logger.info("greedy rows: the full head (it is not one packed bf16 matrix the "
                            "screen can copy)")
            else:
                logger.info("greedy rows: the head's int8 screen (a Q8_0 copy, %.0f MB; the "
                            "bf16 logits of the ids it cannot rule out: the same tokens)",
                            screen.nbytes / 1e6)
            self.head_screen = screen

    @property
    def samples(self) -> bool:
        """Whether this runner samples (and returns) the step's tokens: rank 0 of a tensor
        parallel group; a pipeline stage before the last never gets that far."""
        return self.tp is None or self.tp.is_driver

    @property
    def num_kv_heads(self) -> int:
        """KV heads this runner caches: all, or a tensor parallel rank's share (or the one
        its query heads use; the model's split has checked they divide)."""
        kv = self.config.arch.num_key_value_heads
        return kv if self.tp is None else len(self.tp.kv_heads(kv, "the model"))

    @property
    def num_layers(self) -> int:
        """Decoder layers this runner holds (and caches keys and values for)."""
        stage = self.stage
        return self.config.arch.num_hidden_layers if stage is None else len(stage.layers)

    def kv_block_bytes(self) -> int:
        """Bytes of one KV block over this runner's layers and KV heads."""
        arch = self.config.arch
        whole = kv_block_bytes(arch, self.block_size, self.config.dtype, self.num_layers)
        draft = 0 if self.drafter is None else self.drafter.kv_block_bytes()
        return whole // arch.num_key_value_heads * self.num_kv_heads + draft

    def determine_available_memory(self) -> int:
        """Bytes this runner may give the KV cache: the memory plan's figure, made from the
        checkpoint's metadata before loading (memory/plan.py)."""
        if self.config.cache.num_blocks is None:
            raise ValueError("the engine config has no planned KV cache size (cache.num_blocks)")
        return self.config.cache.num_blocks * self.kv_block_bytes()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate the paged KV cache and bind each Attention layer to its slice; an encoder
        has none (its attention sees the step's own tokens only): the scheduler's blocks are
        then bookkeeping that each request frees after its step."""
        arch = self.config.arch
        if arch.is_encoder:
            return
        self.kv_cache = allocate_kv_cache(self.num_layers, num_blocks, self.block_size,
                                          self.num_kv_heads, arch.head_dim,
                                          self.config.cache.dtype or self.config.dtype,
                                          self.device)
        bind_kv_cache(self.model, self.kv_cache)
        if self.drafter is not None:  # the same block ids address the draft's cache
            self.drafter.initialize_kv_cache(num_blocks)

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step."""
        self._update_states(sched)
        if sched.is_empty:
            return ModelRunnerOutput(sampled={})
        states = [self.requests[r] for r in sched.num_scheduled_tokens]
        step = build_step_inputs(states, list(sched.num_scheduled_tokens.values()),
                                 self.block_size, self.buffers, frozenset(sched.spec_token_ids))
        meta = self.attn_builder.build(step.attn)
        groups = () if self.lora is None else self.lora.groups(step.seqs)
        with set_forward_context(meta), set_lora_groups(groups, step.input_ids.shape[0]):
            hidden = self._forward(step, meta, groups)
        out = ModelRunnerOutput(sampled={})
        if hidden is not None and self.pooler is not None:
            self._pool(step, hidden, out)
        elif hidden is not None:
            self._prompt_logprobs(step, hidden, out)
            self._sample(step, hidden, out, sched.grammar, sched.spec_token_ids)
        for seq in step.seqs:
            seq.state.num_computed_tokens += seq.num_tokens
        for req_id, drafts in sched.spec_token_ids.items():
            # the drafts were this step's inputs only: the scheduler sends the kept ones back
            # with the request's next step, and its computed count without the rejected ones
            del self.requests[req_id].token_ids[-len(drafts):]
        if self.drafter is not None and sched.draft_lengths:
            started = time.perf_counter()
            self._propose(sched.draft_lengths, out)
            # the speculator fits a verify row's cost on the target's time alone
            out = dataclasses.replace(out, draft_seconds=time.perf_counter() - started)
        return out

    def _propose(self, lengths: dict[str, int], out: ModelRunnerOutput) -> None:
        """The draft model's next drafts for the requests that sampled in this step, after
        their tokens and the ones just sampled (kept drafts and the target's token); a
        request asked 0 (a prompt chunk) brings the draft's cache up to the target's."""
        jobs = []
        for req_id, k in lengths.items():
            st = self.requests[req_id]
            if k == 0:
                jobs.append(DraftJob(req_id, st.token_ids[:st.num_computed_tokens],
                                     st.block_ids, 0))
                continue
            new = out.spec_token_ids.get(req_id)
            if new is None and req_id in out.sampled:
                new = [out.sampled[req_id]]
            if new and req_id not in out.errors:
                jobs.append(DraftJob(req_id, st.token_ids + new, st.block_ids, k))
        out.draft_token_ids.update(self.drafter.propose(jobs))

    def _forward(self, step: StepInputs, meta: AttentionMetadata,
                 groups: tuple[LoRAGroup, ...]) -> Optional[torch.Tensor]:
        """The model (or its captured decode step, unless a request has a LoRA adapter) over
        the step: hidden states [T, H], or None on a pipeline stage before the last, which
        sends its stream on instead."""
        stage = self.stage
        incoming = None if stage is None or stage.is_first else recv_from_prev(
            stage, step.input_ids.shape[0], self.config.arch.hidden_size, self.config.dtype,
            self.device, self.tp)
        captured = self.captured_decode is not None and meta.decode_only
        if captured and groups and not self._stack_lora:
            captured = False
            if not self._told_lora_decode:
                self._told_lora_decode = True
                logger.info("decode steps with a LoRA adapter run the model's layer loop: the "
                            "C++ decode stack applies LoRA only with the C++ ops (float32)")
        if captured:
            result = self.captured_decode(step.input_ids, step.positions, self.kv_cache, meta,
                                          incoming, step_lora_slots())
        elif self.pooler is not None:
            result = self.model(step.input_ids, step.positions, incoming,
                                **self._token_types(step))
        else:
            result = self.model(step.input_ids, step.positions, incoming)
        if stage is None or stage.is_last:
            return result
        send_to_next(stage, result, self.tp)
        return None

    def _update_states(self, sched: SchedulerOutput) -> None:
        for req_id in sched.finished_req_ids:
            self.requests.pop(req_id, None)
            if self.drafter is not None:
                self.drafter.forget(req_id)
        for new in sched.new_reqs:
            if self.drafter is not None:  # new, or resumed from scratch after preemption
                self.drafter.forget(new.req_id)
            # a request resumed after preemption keeps its RNG and what it already returned
            old = self.requests.get(new.req_id)
            generator = old.generator if old else self._make_generator(new.sampling_params.seed)
            self.requests[new.req_id] = CachedRequestState(
                new.req_id, list(new.token_ids), new.num_prompt_tokens, new.sampling_params,
                generator, list(new.block_ids), new.num_computed_tokens,
                old.num_prompt_logprobs if old else 0, new.pooling_params, new.lora_request)
        for cached in sched.cached_reqs:
            st = self.requests[cached.req_id]
            st.token_ids.extend(cached.new_token_ids)  # sampled here or on another rank
            st.block_ids.extend(cached.new_block_ids)
            st.num_computed_tokens = cached.num_computed_tokens
        for req_id, drafts in sched.spec_token_ids.items():
            self.requests[req_id].token_ids.extend(drafts)  # computed after its last token

    def _token_types(self, step: StepInputs) -> dict[str, torch.Tensor]:
        """{"token_type_ids": [T]} when a sequence of the step is a text pair (a cross-encoder's
        query and document: type 1 from where the second text starts) and the model reads token
        types, else {}."""
        starts = [(seq, seq.state.pooling_params.second_text_start) for seq in step.seqs
                  if seq.state.pooling_params is not None]
        if not self.config.arch.uses_token_types or all(first is None for _, first in starts):
            return {}
        types = torch.zeros(step.input_ids.shape[0], dtype=torch.int64, device=self.device)
        for seq, first in starts:
            if first is not None:  # a pooling step holds whole sequences from their token 0
                types[seq.start + first:seq.start + seq.num_tokens] = 1
        return {"token_type_ids": types}

    def _pool(self, step: StepInputs, hidden: torch.Tensor, out: ModelRunnerOutput) -> None:
        """The vector of each pooling request whose last token this step reads, from its rows
        of the hidden states (a decoder's earlier chunks give nothing)."""
        done = [s for s in step.seqs
                if s.state.num_computed_tokens + s.num_tokens == len(s.state.token_ids)]
        vectors = self.pooler(hidden, [(s.start, s.num_tokens) for s in done],
                              [s.state.pooling_params for s in done])
        for seq, vec in zip(done, vectors):
            out.pooled[seq.state.req_id] = vec

    def _make_generator(self, seed: Optional[int]) -> Optional[torch.Generator]:
        if seed is None:
            return None
        return torch.Generator(device=self.device).manual_seed(seed)

    def _sample(self, step: StepInputs, hidden: torch.Tensor, out: ModelRunnerOutput,
                grammar: Optional[GrammarBitmask], spec: dict[str, list[int]]) -> None:
        """Sample each request that reached its last token: one row, or with k drafts one row
        per draft position and one after them (sample/rejection.py), each row's history
        holding the drafts before it (penalties and min_tokens see what that position sees).
        Plain greedy rows the head screen decides take no logits; the rest the sampler's."""
        seqs = [s for s in step.seqs if s.samples]
        if not seqs:
            return
        width = [1 + len(spec.get(s.state.req_id, ())) for s in seqs]
        rows = [s.start + s.num_tokens - w + j for s, w in zip(seqs, width) for j in range(w)]
        # row r belongs to states[r] and sees outputs[r] (its drafts before it, if any)
        states = [s.state for s, w in zip(seqs, width) for _ in range(w)]
        outputs = [s.state.token_ids[s.state.num_prompt_tokens:len(s.state.token_ids) - w + 1 + j]
                   for s, w in zip(seqs, width) for j in range(w)]
        # plain greedy rows the head screen decides take no logits (a 1-row request has no drafts)
        screened = self._screen_greedy(states, outputs, hidden, rows, grammar,
                                       [w for w in width for _ in range(w)])
        rest = [i for i in range(len(rows)) if i not in screened]
        tokens: list[int] = [screened.get(i, 0) for i in range(len(rows))]
        result = None
        if rest:
            logits = self.model.compute_logits(  # [R, V]; every tensor rank gathers
                hidden[torch.tensor([rows[i] for i in rest], device=self.device)])
            if not self.samples:
                return  # tensor parallel rank > 0: rank 0 samples, its tokens come next step
            rstates = [states[i] for i in rest]
            generators = {j: st.generator for j, st in enumerate(rstates)
                          if st.generator is not None}
            meta = SamplingMetadata.from_params(
                [st.sampling_params for st in rstates], [st.prompt_token_ids for st in rstates],
                [outputs[i] for i in rest], generators, self.vocab_size, self.eos_token_ids,
                self.device)
            if grammar is not None:
                meta.grammar_bitmask = _bitmask_rows(grammar, [st.req_id for st in rstates],
                                                     self.vocab_size, self.device)
            result = self.sampler(logits, meta)
            for i, tok in zip(rest, result.sampled_token_ids.tolist()):
                tokens[i] = tok
            for j in result.no_allowed_token:
                out.errors[rstates[j].req_id] = (
                    "no token is allowed: the request's constraints together exclude every "
                    "token (allowed_token_ids, structured output, min_tokens' ban on EOS)")
            for j in result.not_finite:
                out.errors[rstates[j].req_id] = (
                    "sampling failed: the model's logits for this request are not finite "
                    "(NaN), so no token could be drawn")
        # a row's place among the sampler's rows (its logprobs' row); screened rows have none
        at = {i: j for j, i in enumerate(rest)}
        first = 0
        for seq, w in zip(seqs, width):
            st, row = seq.state, first
            first += w
            if st.req_id in out.errors:
                continue  # fails at the scheduler's update
            k = st.sampling_params.logprobs
            lp = None if result is None or k is None else result.logprobs
            if w == 1:
                out.sampled[st.req_id] = tokens[row]  # the state gets it with the next step
                if lp is not None:
                    out.logprobs[st.req_id] = _row_logprobs(lp, at[row], k)
                continue
            kept = verify_point_mass(tokens[row:row + w], spec[st.req_id])
            out.spec_token_ids[st.req_id] = kept
            if lp is not None:
                out.spec_logprobs[st.req_id] = [_row_logprobs(lp, at[row] + j, k)
                                                for j in range(len(kept))]

    def _screen_greedy(self, states: list[CachedRequestState], outputs: list[list[int]],
                       hidden: torch.Tensor, rows: list[int], grammar: Optional[GrammarBitmask],
                       width: list[int]) -> dict[int, int]:
        """Row -> token for the plain greedy rows (nothing but the argmax of the logits: no
        logprobs, penalties, logit_bias, allowed ids, min_tokens ban, grammar or drafts) that the
        head screen decides; the rest take the logits and the sampler."""
        if self.head_screen is None:
            return {}
        constrained = set(grammar.req_ids) if grammar is not None else set()
        plain = [i for i, (st, o) in enumerate(zip(states, outputs))
                 if width[i] == 1 and st.req_id not in constrained
                 and _plain_greedy(st.sampling_params, len(o))]
        if not plain:
            return {}
        got = self.head_screen.argmax(
            hidden[torch.tensor([rows[i] for i in plain], device=self.device)],
            len(rows)).tolist()
        return {i: tok for i, tok in zip(plain, got) if tok >= 0}

    def _prompt_logprobs(self, step: StepInputs, hidden: torch.Tensor,
                         out: ModelRunnerOutput) -> None:
        for seq in step.seqs:
            k = seq.state.sampling_params.prompt_logprobs
            if k is None:
                continue
            st = seq.state
            # position p predicts prompt token p + 1; a recompute skips positions already returned
            first = max(st.num_computed_tokens, st.num_prompt_logprobs)
            last = min(st.num_computed_tokens + seq.num_tokens, st.num_prompt_tokens - 1)
            if last <= first:
                continue
            row0 = seq.start + first - st.num_computed_tokens
            entries = []
            # a few rows of logits at a time: [1024, 152k] float32 logits and their log-softmax
            # would take 1.2 GB at once
            for start in range(first, last, PROMPT_LOGPROBS_ROWS):
                end = min(start + PROMPT_LOGPROBS_ROWS, last)
                rows = hidden[row0 + start - first:row0 + end - first]
                logits = self.model.compute_logits(rows)  # [rows, V]
                targets = torch.tensor(st.token_ids[start + 1:end + 1], device=self.device)
                if self.samples:
                    lp = compute_prompt_logprobs(logits, targets, k)
                    entries += [_row_logprobs(lp, i, k) for i in range(end - start)]
            if self.samples:
                out.prompt_logprobs[st.req_id] = entries
            st.num_prompt_logprobs = last


def _bitmask_rows(grammar: GrammarBitmask, req_ids: list[str], vocab_size: int,
                  device: torch.device) -> torch.Tensor:
    """The scheduler's bitmask rows in the order of this step's sampling rows (req_ids: the
    request of each); rows of free requests allow every id. A request's sampling rows take
    its bitmask rows in order: [last token, draft 1, ..., draft k] of a verify."""
    where: dict[str, list[int]] = {}
    for i, req_id in enumerate(grammar.req_ids):
        where.setdefault(req_id, []).append(i)
    targets = [i for i, req_id in enumerate(req_ids) if req_id in where]
    sources = [i for req_id in dict.fromkeys(req_ids) for i in where.get(req_id, ())]
    counts = Counter(req_ids)
    wrong = [r for r, mine in where.items() if counts[r] and counts[r] != len(mine)]
    if wrong:
        raise RuntimeError(f"request {wrong[0]} has {len(where[wrong[0]])} grammar bitmask "
                           f"rows for {counts[wrong[0]]} sampling rows")
    rows = allocate_bitmask(len(req_ids), vocab_size)
    if targets:
        rows[targets] = grammar.bitmask[sources]
    return rows.to(device)


def _plain_greedy(p: SamplingParams, num_output: int) -> bool:
    """Whether a row's token is the argmax of its raw logits and nothing else is wanted of them."""
    return (p.is_greedy and p.logprobs is None and p.presence_penalty == 0.0
            and p.frequency_penalty == 0.0 and p.repetition_penalty == 1.0
            and not p.logit_bias and not p.allowed_token_ids and num_output >= p.min_tokens)


def _row_logprobs(lp: LogprobsTensors, row: int, k: int) -> TokenLogprobs:
    """Row `row` of batched logprobs, keeping the chosen token and the top k."""
    return TokenLogprobs(lp.token_ids[row, :k + 1].tolist(), lp.logprobs[row, :k + 1].tolist(),
                         int(lp.ranks[row]))
