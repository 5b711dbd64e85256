"""Sampler: logits of the rows that sample this step -> next token ids (+ logprobs)."""

from dataclasses import dataclass, field
from typing import Optional

import torch

from pagedllm.sample import ops
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.top_k import apply_top_p, sample_candidates, top_k_candidates
from pagedllm.sampling_params import SAMPLING_EPS
from pagedllm.structured_output.bitmask import apply_bitmask_


@dataclass
class LogprobsTensors:
    """Logprobs of the chosen token (column 0) and the top-K tokens of each row."""

    token_ids: torch.Tensor  # [N, K+1] int64: column 0 = sampled token, then top-K ids
    logprobs: torch.Tensor  # [N, K+1] float32
    ranks: torch.Tensor  # [N] int64: rank of the sampled token (1 = most likely)


@dataclass
class SamplerOutput:
    """One sampled token per row, plus logprobs when any row asked for them."""

    sampled_token_ids: torch.Tensor  # [N] int64
    logprobs: Optional[LogprobsTensors]
    # rows whose constraints together allow no token at all (their draw is meaningless): e.g.
    # allowed_token_ids disjoint from the grammar's, or min_tokens banning the only EOS left
    no_allowed_token: list[int] = field(default_factory=list)
    # rows with no probabilities to draw from (NaN logits): their id is 0, not a token
    not_finite: list[int] = field(default_factory=list)


class Sampler(torch.nn.Module):
    """grammar mask -> allowed ids -> logit bias -> min-tokens bans -> penalties
    -> greedy | temperature -> min-p -> top-k/top-p -> sample (vLLM v1 order).

    cpu_ops: take the greedy argmax and the random rows' filters and draw with pagedllm's C++
    ops (the platform decides, once): kernels/csrc/sampling.cpp draws each random row in a few
    passes over its logits, where the PyTorch path sorts the vocabulary for top-p (32 rows of a
    152k vocabulary, top_p 0.95: ~300 ms a step, against 2-5)."""

    def __init__(self, cpu_ops: bool = False) -> None:
        super().__init__()
        self._argmax = ops.argmax_cpu if cpu_ops else ops.argmax
        self._cpu_ops = cpu_ops

    def forward(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """Sample one token per row of logits [N, V]; never modifies the caller's tensor."""
        # [N, V]; no copy when already float32 (a 152k-vocabulary row is 600 KB, and the copy cost
        # ~0.3 ms a step): the in-place edits below get their own copy
        logits = logits.float()
        owned = meta.grammar_bitmask is not None  # already a copy of the caller's tensor
        if owned:  # structured outputs: disallowed ids never drawn
            logits = apply_bitmask_(logits.clone(), meta.grammar_bitmask)
        # Logprobs describe the model, so they come from the raw logits (vLLM "raw_logprobs").
        raw_logprobs = None
        if meta.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1)  # [N, V]
        restricted = owned or meta.disallowed_mask is not None
        logits = _apply_request_edits(logits, meta, owned)
        no_allowed = []
        if restricted:  # only a grammar or allowed_token_ids can leave a row with no token
            no_allowed = torch.isneginf(logits).all(dim=-1).nonzero().flatten().tolist()
        if not meta.no_penalties:
            logits = ops.apply_penalties(
                logits,
                meta.prompt_token_ids,
                meta.output_token_ids,
                meta.presence_penalties,
                meta.frequency_penalties,
                meta.repetition_penalties,
            )
        sampled = self._sample(logits, meta)  # [N]
        # a row whose CDF is NaN (or all zero) finds no id inside the vocabulary; that request
        # fails alone, and no id past the embedding reaches the next step
        outside = ((sampled < 0) | (sampled >= logits.shape[1])).nonzero().flatten().tolist()
        not_finite = [i for i in outside if i not in no_allowed]
        if outside:
            sampled[outside] = 0
        logprobs = None
        if raw_logprobs is not None:
            assert meta.max_num_logprobs is not None
            ids, vals, ranks = ops.gather_logprobs(raw_logprobs, sampled, meta.max_num_logprobs)
            logprobs = LogprobsTensors(token_ids=ids, logprobs=vals, ranks=ranks)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs,
                             no_allowed_token=no_allowed, not_finite=not_finite)

    def _sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Greedy rows take the argmax; random rows are filtered and drawn."""
        if meta.all_greedy:
            return self._argmax(logits)  # [N]
        greedy = None if meta.all_random else self._argmax(logits)  # [N]
        temperature = meta.temperature.to(logits.device)  # [N]
        is_greedy = temperature < SAMPLING_EPS
        # Greedy rows get temperature 1 only to avoid dividing by zero; their draw is discarded.
        temperature = torch.where(is_greedy, 1.0, temperature)
        # Greedy rows leave their generator untouched, so mixing batches cannot advance it.
        greedy_rows = is_greedy.tolist() if meta.generators else []
        seeded = {row for row in meta.generators if not greedy_rows[row]}
        if self._cpu_ops:
            # one uniform number a row, a seeded row's from its own generator
            u = ops.uniforms(logits.shape[0], meta.generators, sorted(seeded), torch.device("cpu"))
            drawn = ops.sample_rows(logits, temperature, meta.top_k, meta.top_p, meta.min_p, u)
            return drawn if greedy is None else torch.where(is_greedy, greedy, drawn)
        logits = logits / temperature.unsqueeze(1)
        if meta.min_p is not None:
            logits = ops.apply_min_p(logits, meta.min_p.to(logits.device))
        top_k = None if meta.top_k is None else meta.top_k.to(logits.device)
        top_p = None if meta.top_p is None else meta.top_p.to(logits.device)
        drawn = _draw(logits, ~is_greedy.cpu(), top_k, top_p, meta.generators, seeded)  # [N]
        if greedy is None:
            return drawn
        return torch.where(is_greedy, greedy, drawn)


def _draw(logits: torch.Tensor, random: torch.Tensor, top_k: Optional[torch.Tensor],
          top_p: Optional[torch.Tensor], generators: dict[int, torch.Generator],
          seeded: set[int]) -> torch.Tensor:
    """One draw per random row (random [N] bool, on the CPU) of logits [N, V] after
    top-k/top-p: rows with a small top_k among their k candidates (sample/top_k.py), the others
    over the whole vocabulary; other rows' entries are left undefined."""
    drawn = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)  # [N]
    full = random.clone()
    cand = top_k_candidates(logits, top_k, top_p)
    if cand is not None:
        if top_p is not None:
            apply_top_p(cand, top_p[cand.rows])
        rows = cand.rows.tolist()
        gens = {i: generators[r] for i, r in enumerate(rows) if r in seeded}
        drawn[cand.rows] = sample_candidates(cand, gens)
        full[cand.rows.cpu()] = False
    rest = full.nonzero().flatten().tolist()
    if rest:
        whole = len(rest) == logits.shape[0]
        sub = ops.apply_top_k_top_p(logits if whole else logits[rest],
                                    _rows_of(top_k, rest, whole), _rows_of(top_p, rest, whole))
        probs = torch.softmax(sub, dim=-1)  # [R, V]
        gens = {i: generators[r] for i, r in enumerate(rest) if r in seeded}
        drawn[rest] = ops.random_sample(probs, gens, sorted(gens))
    return drawn


def _rows_of(t: Optional[torch.Tensor], rows: list[int], whole: bool) -> Optional[torch.Tensor]:
    return t if t is None or whole else t[rows]


def _apply_request_edits(logits: torch.Tensor, meta: SamplingMetadata,
                         owned: bool) -> torch.Tensor:
    """allowed_token_ids, then logit_bias, then min_tokens bans (vLLM's order), in place on one
    copy of logits [N, V] (none when `owned` or when no row uses any of them)."""
    bias = meta.logit_bias
    if meta.disallowed_mask is None and bias is None and not meta.banned_token_ids:
        return logits
    if not owned:
        logits = logits.clone()
    if meta.disallowed_mask is not None:
        logits.masked_fill_(meta.disallowed_mask, float("-inf"))
    if bias is not None:
        logits.index_put_((bias.rows, bias.token_ids), bias.values, accumulate=True)
    return ops.ban_tokens(logits, meta.banned_token_ids)


def compute_prompt_logprobs(
    logits: torch.Tensor, target_ids: torch.Tensor, num_logprobs: int
) -> LogprobsTensors:
    """Logprobs of each next prompt token; logits [T, V] at prompt positions, target_ids [T]."""
    if num_logprobs < 0:
        raise ValueError(f"num_logprobs must be >= 0, got {num_logprobs}")
    logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)  # [T, V]
    ids, vals, ranks = ops.gather_logprobs(logprobs, target_ids, num_logprobs)
    return LogprobsTensors(token_ids=ids, logprobs=vals, ranks=ranks)
