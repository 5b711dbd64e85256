"""Pure tensor operations of the sampler: bans, penalties, filters, sampling, logprob gathering."""

from itertools import chain
from typing import Optional

import torch

from pagedllm.sampling_params import SAMPLING_EPS


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, dim=-1) for [N, V]."""
    return logits.argmax(dim=-1)


def argmax_cpu(logits: torch.Tensor) -> torch.Tensor:
    """The same for float32 CPU logits [N, V] through a vectorized C++ op (torch's takes ~0.35 ms
    a row over a 152k vocabulary, single-threaded); ties go to the first index, NaN wins."""
    return torch.ops.pagedllm.argmax_rows(logits.float().contiguous())


def ban_tokens(logits: torch.Tensor, banned: dict[int, list[int]]) -> torch.Tensor:
    """Set the banned ids of each row to -inf, in place; logits [N, V]."""
    if not banned:
        return logits
    rows = [row for row, ids in banned.items() for _ in ids]
    cols = [tok for ids in banned.values() for tok in ids]
    rows_t = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    cols_t = torch.tensor(cols, dtype=torch.int64, device=logits.device)
    logits[rows_t, cols_t] = float("-inf")
    return logits


def token_counts(token_ids: list[list[int]], vocab_size: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The distinct (row, id) pairs of token_ids with their counts: rows [K], ids [K], counts [K]
    int64 (ids outside the vocabulary left out). Sparse: a dense [N, V] count of 32 rows of a
    152k vocabulary took ~100 ms a step."""
    lengths = torch.tensor([len(ids) for ids in token_ids], dtype=torch.int64)
    flat = torch.tensor(list(chain.from_iterable(token_ids)), dtype=torch.int64)  # [L]
    rows = torch.repeat_interleave(torch.arange(len(token_ids)), lengths)  # [L]
    inside = (flat >= 0) & (flat < vocab_size)
    keys, counts = torch.unique(rows[inside] * vocab_size + flat[inside], return_counts=True)
    return (keys // vocab_size).to(device), (keys % vocab_size).to(device), counts.to(device)


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> torch.Tensor:
    """vLLM/HF penalties: repetition over prompt+output, presence/frequency over output only.
    Only the ids a row has seen change; each gets the float operations the dense form gave it."""
    vocab = logits.shape[1]
    logits = logits.clone()
    seen_rows, seen_ids, _ = token_counts([p + o for p, o in zip(prompt_token_ids, output_token_ids)],
                                          vocab, logits.device)
    vals = logits[seen_rows, seen_ids]  # [K]
    rep = repetition.to(logits.device)[seen_rows]
    # Shrinking a logit toward zero lowers its probability whatever its sign. A penalty that is
    # 0 in float32 (5e-324 is > 0 and valid) would make a positive logit inf and a banned one
    # (-inf) NaN: the first stops at a float that stays finite after the smallest temperature
    # that samples, the second stays banned.
    shrunk = torch.where(vals > 0, vals / rep, vals * rep)
    shrunk = torch.where(torch.isneginf(vals), vals, shrunk)
    logits[seen_rows, seen_ids] = shrunk.clamp_(max=torch.finfo(shrunk.dtype).max
                                                * SAMPLING_EPS / 2)
    rows, ids, counts = token_counts(output_token_ids, vocab, logits.device)
    vals = logits[rows, ids] - frequency.to(logits.device)[rows] * counts
    logits[rows, ids] = vals - presence.to(logits.device)[rows]
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the row's top probability."""
    probs = torch.softmax(logits, dim=-1)  # [N, V]
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)  # [N, 1]
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: Optional[torch.Tensor], top_p: Optional[torch.Tensor]
) -> torch.Tensor:
    """Keep each row's k most likely tokens, then its smallest nucleus of mass >= p."""
    if top_k is None and top_p is None:
        return logits
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=False)  # [N, V] ascending
    if top_k is not None:
        # The k-th largest value sits at index V - k of the ascending sort; ties with it stay.
        kth = sorted_logits.gather(1, (vocab - top_k.clamp(1, vocab)).unsqueeze(1))  # [N, 1]
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)  # [N, V]
        drop = cum <= 1.0 - top_p.unsqueeze(1)
        drop[:, -1] = False  # always keep the most likely token
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def uniforms(n: int, generators: dict[int, torch.Generator], seeded_rows: list[int],
             device: torch.device) -> torch.Tensor:
    """n float64 uniforms in [0, 1), one a row: a seeded row's from its own generator, so that
    other rows cannot shift it; the others' from torch's."""
    u = torch.empty(n, dtype=torch.float64, device=device)  # [N]
    if len(seeded_rows) < n:
        u.uniform_()
    for row in seeded_rows:
        u[row:row + 1].uniform_(generator=generators[row])
    return u


def random_sample(
    probs: torch.Tensor, generators: dict[int, torch.Generator], seeded_rows: list[int]
) -> torch.Tensor:
    """One draw per row of probs [N, V], by inverting the row's CDF at one uniform number.

    vLLM draws an exponential for every id instead (argmax of p / q); on the CPU torch makes
    those one at a time, 93 ms for 32 rows of a 152k vocabulary on one Zen 4 core, against
    17 ms for this (a float64 cumsum: float32 would drift by up to V x 6e-8 over the row)."""
    u = uniforms(probs.shape[0], generators, seeded_rows, probs.device)  # [N]
    cdf = probs.to(torch.float64).cumsum_(dim=-1)  # [N, V]
    total = cdf[:, -1]  # [N]; 1 up to rounding
    # Strictly below the total, so the id found is one whose probability is not zero.
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1)  # [N]


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: Optional[torch.Tensor],
                top_p: Optional[torch.Tensor], min_p: Optional[torch.Tensor],
                u: torch.Tensor) -> torch.Tensor:
    """One id per row of logits [N, V] (kernels/csrc/sampling.cpp): z = logits / temperature,
    then min-p, top-k, top-p as the full path filters, and the kept ids' CDF in id order
    inverted at u [N] (float64 in [0, 1)); -1 where a row's logits are not finite."""
    out = torch.ops.pagedllm.sample_rows(logits.float().contiguous(), temperature.float(),
                                         top_k, top_p, min_p, u)
    return out.to(logits.device)


def gather_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Chosen token's logprob and rank plus the top-k; logprobs [N, V], token_ids [N]."""
    k = min(num_logprobs, logprobs.shape[1])
    top_vals, top_ids = logprobs.topk(k, dim=-1)  # [N, K] sorted descending
    token_ids = token_ids.to(torch.int64).unsqueeze(1)  # [N, 1]
    token_lp = logprobs.gather(1, token_ids)  # [N, 1]
    ranks = (logprobs >= token_lp).sum(dim=-1)  # [N]; 1 = most likely
    ids = torch.cat([token_ids, top_ids], dim=1)  # [N, K+1]
    vals = torch.cat([token_lp, top_vals], dim=1)  # [N, K+1]
    return ids, vals, ranks
