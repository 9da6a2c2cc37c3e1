"""Per-step token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds and logprobs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedserve_common.step import PositionLogprobs, TokenLogprob
from pagedserve_common.sampling import SamplingParams
from worker_svc.cpu_ops import shared_ops
from worker_svc.uniforms import seeded_uniforms

# Slack for float32 rounding in the nucleus cumsum: without it, a crafted distribution whose head sums to
# exactly top_p (0.5 + 0.3 vs 0.8) keeps one extra token or not depending on the rounding direction.
TOP_P_EPS = 1e-6
CANDIDATES = 256  # most likely tokens a top-p row is sampled from (more only when they hold less than top_p)


@dataclass(slots=True)
class SampleOutput:
    """One sampled token per row, plus logprobs for the rows that asked for them."""

    token_ids: list[int]
    logprobs: list[PositionLogprobs | None]


class Sampler:
    """Turns a batch of last-position logits into next tokens.

    Logprobs are those of the model's raw distribution, log_softmax of the logits before temperature,
    top-k, top-p and min-p (vLLM's default), so they do not depend on the sampling settings.
    positions[i] is the number of tokens row i's sequence knows when it samples: with the row's seed, it fixes
    the row's randomness (worker_svc.uniforms).
    """

    def sample(self, logits: torch.Tensor, options: list[SamplingParams], positions: list[int],
               process: Callable[[torch.Tensor], None] | None = None) -> SampleOutput:
        """`process`, when given, changes the (float32) logits in place before sampling (worker_svc.logits); the
        logprobs are taken before it."""
        # NOTE: options are validated once on admission (the scheduler's SamplingParams.validate), not every step.
        if logits.dim() != 2:
            raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}")
        b = logits.shape[0]
        if len(options) != b or len(positions) != b:
            raise ValueError(f"batch of {b} rows but {len(options)} options and {len(positions)} positions")
        if process is None and all(o.greedy and o.logprobs is None for o in options):
            # NOTE: a bfloat16 model's logits: their float32 values are exact copies, so the argmax (ties ->
            # lowest id) is the same without the [B, V] conversion
            return SampleOutput(token_ids=_argmax(logits).tolist(), logprobs=[None] * b)
        logits = logits.float()
        raw_lp = _raw_logprobs(logits, options)
        if process is not None:
            logits = logits.contiguous()  # NOTE: a no-op for the model's logits; the processor works on flat indices
            process(logits)
        random_rows = [i for i, o in enumerate(options) if not o.greedy]
        if not random_rows:  # NOTE: the common case: one argmax over the rows as they are, no copy
            token_ids = _argmax(logits)  # ties -> lowest id, as transformers' greedy does
        else:
            token_ids = torch.empty(b, dtype=torch.long, device=logits.device)
            greedy = [i for i, o in enumerate(options) if o.greedy]
            if greedy:
                idx = torch.tensor(greedy, device=logits.device)
                token_ids[idx] = _argmax(logits[idx])
            idx = torch.tensor(random_rows, device=logits.device)
            token_ids[idx] = _sample_rows(logits[idx], [options[i] for i in random_rows],
                                          _uniforms([options[i].seed for i in random_rows],
                                                    [positions[i] for i in random_rows], logits.device))

        ids = token_ids.tolist()
        return SampleOutput(token_ids=ids, logprobs=_logprobs(raw_lp, token_ids, ids, options))


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (ties -> lowest id): the CPU kernel library's one pass where it runs (torch's argmax takes
    ~4 ms over [64, 49,152] float32 rows on a core, 10 ms in bfloat16), else torch's. NOTE: a NaN logit (a bug
    upstream) wins in torch's and never in ours."""
    ops = shared_ops() if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.bfloat16) and \
        logits.dim() == 2 and logits.stride(-1) == 1 else None
    return logits.argmax(dim=-1) if ops is None else ops.argmax(logits)


def _filtered_probs(logits: torch.Tensor, options: list[SamplingParams]) -> torch.Tensor:
    """The exact full-sort path, for rows whose nucleus is wider than the candidates: temperature, then top-k,
    top-p and min-p as masks over one batched sort of the whole vocabulary; returns probabilities."""
    n, v = logits.shape
    dev = logits.device
    temp = torch.tensor([o.temperature for o in options], dtype=torch.float32, device=dev)
    x = logits / temp[:, None]

    # Stable sort so equal logits keep vocab order: the kept set is then a function of the row alone.
    sorted_x, order = x.sort(dim=-1, descending=True, stable=True)
    pos = torch.arange(v, device=dev)[None, :]

    top_k = torch.tensor([o.top_k if 0 < o.top_k < v else v for o in options], device=dev)
    sorted_x = sorted_x.masked_fill(pos >= top_k[:, None], float("-inf"))

    top_p = torch.tensor([o.top_p for o in options], dtype=torch.float32, device=dev)
    probs = torch.softmax(sorted_x, dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of the strictly more likely tokens
    # Keep token i while the mass before it is still short of top_p: the smallest set reaching top_p.
    drop_p = (before >= (top_p - TOP_P_EPS)[:, None]) & (top_p < 1)[:, None]
    drop_p[:, 0] = False  # NOTE: the most likely token always survives, so no row is left empty
    sorted_x = sorted_x.masked_fill(drop_p, float("-inf"))

    min_p = torch.tensor([o.min_p for o in options], dtype=torch.float32, device=dev)
    # p_i / p_max = exp(x_i - x_max), invariant to renormalisation after top-k/top-p; the top token's ratio
    # is 1 >= min_p, so it survives here too.
    ratio = torch.exp(sorted_x - sorted_x[:, :1])
    sorted_x = sorted_x.masked_fill(ratio < min_p[:, None], float("-inf"))

    masked = torch.full_like(x, float("-inf")).scatter(1, order, sorted_x)
    return torch.softmax(masked, dim=-1)


def _uniforms(seeds: list[int | None], positions: list[int], device) -> torch.Tensor:
    """One uniform in [0, 1) per row: the seeded rows' from one vectorised seeded_uniforms(seed, position) call,
    the unseeded rows' (if any) from one draw of the global generator."""
    seeded = [i for i, s in enumerate(seeds) if s is not None]
    if len(seeded) == len(seeds):  # NOTE: the worker's case: the scheduler gives every sequence a seed
        u = torch.from_numpy(seeded_uniforms(seeds, positions))
    else:
        u = torch.rand(len(seeds), dtype=torch.float64)
        if seeded:
            u[seeded] = torch.from_numpy(seeded_uniforms([seeds[i] for i in seeded], [positions[i] for i in seeded]))
    return u.to(device)


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Row i's index j with cdf[j-1] <= u_i * total < cdf[j]: exact sampling from unnormalised `probs` [n, m]."""
    cdf = probs.double().cumsum(dim=-1)  # float64: no drift over a 50k-token vocabulary
    idx = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(1)
    return idx.clamp_(max=probs.shape[1] - 1)  # NOTE: zero-probability tokens have empty intervals: never hit


def _sample_rows(logits: torch.Tensor, options: list[SamplingParams], u: torch.Tensor) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p, then one inverse-CDF draw per row.

    Rows with top-k or top-p work on their CANDIDATES (one batched topk, sorted), never on a sort of the whole
    vocabulary: top-k needs only its k, and a nucleus almost always lies inside the CANDIDATES most likely tokens
    (checked per row; the rare row whose candidates hold less than top_p of the mass takes the full-sort path).
    """
    n, v = logits.shape
    dev = logits.device
    temp = torch.tensor([o.temperature for o in options], dtype=torch.float32, device=dev)
    x = logits / temp[:, None]
    top_k = [o.top_k if 0 < o.top_k < v else 0 for o in options]
    cand = [i for i, o in enumerate(options) if top_k[i] or o.top_p < 1]
    out = torch.empty(n, dtype=torch.long, device=dev)
    if len(cand) < n:  # no top-k/top-p: the whole vocabulary, min-p as a mask relative to the row's max
        in_cand = set(cand)
        rows = torch.tensor([i for i in range(n) if i not in in_cand], device=dev)
        xf = x[rows]
        min_p = [options[i].min_p for i in rows.tolist()]
        if any(min_p):
            threshold = torch.tensor(min_p, dtype=torch.float32, device=dev)[:, None]
            xf = xf.masked_fill(torch.exp(xf - xf.max(dim=-1, keepdim=True).values) < threshold, float("-inf"))
        out[rows] = _inverse_cdf(torch.softmax(xf, dim=-1), u[rows])
    if not cand:
        return out
    opts = [options[i] for i in cand]
    rows = torch.tensor(cand, device=dev)
    xc = x[rows]
    ks = [top_k[i] for i in cand]
    width = min(v, max(max(ks), CANDIDATES if any(k == 0 for k in ks) else 0))
    vals, ids = xc.topk(width, dim=-1)  # sorted, most likely first
    pos = torch.arange(width, device=dev)[None, :]
    k_t = torch.tensor([k or width for k in ks], device=dev)
    vals = vals.masked_fill(pos >= k_t[:, None], float("-inf"))
    # The candidates' probabilities: renormalised within top-k where there is one, else over the whole row.
    has_k = torch.tensor([k > 0 for k in ks], device=dev)
    lse = torch.where(has_k, torch.logsumexp(vals, dim=-1), torch.logsumexp(xc, dim=-1))
    probs = torch.exp(vals - lse[:, None])
    top_p = torch.tensor([o.top_p for o in opts], dtype=torch.float32, device=dev)
    short = (probs.sum(dim=-1) < top_p - TOP_P_EPS) & (top_p < 1)
    before = probs.cumsum(dim=-1) - probs  # mass of the strictly more likely tokens
    # Keep token i while the mass before it is still short of top_p: the smallest set reaching top_p.
    drop_p = (before >= (top_p - TOP_P_EPS)[:, None]) & (top_p < 1)[:, None]
    drop_p[:, 0] = False  # NOTE: the most likely token always survives, so no row is left empty
    vals = vals.masked_fill(drop_p, float("-inf"))
    min_p = torch.tensor([o.min_p for o in opts], dtype=torch.float32, device=dev)
    # p_i / p_max = exp(x_i - x_max), invariant to renormalisation after top-k/top-p.
    vals = vals.masked_fill(torch.exp(vals - vals[:, :1]) < min_p[:, None], float("-inf"))
    picked = ids.gather(1, _inverse_cdf(torch.softmax(vals, dim=-1), u[rows])[:, None]).squeeze(1)
    if short.any():  # a nucleus wider than the candidates: the exact full-sort path for those rows
        which = short.nonzero().squeeze(1)
        probs_full = _filtered_probs(logits[rows[which]], [opts[j] for j in which.tolist()])
        picked[which] = _inverse_cdf(probs_full, u[rows[which]])
    out[rows] = picked
    return out


def _raw_logprobs(logits: torch.Tensor, options: list[SamplingParams]) -> torch.Tensor | None:
    """log_softmax of the raw logits of the rows that asked for logprobs (None: no row did)."""
    rows = [i for i, o in enumerate(options) if o.logprobs is not None]
    if not rows:
        return None
    return torch.log_softmax(logits[torch.tensor(rows, device=logits.device)], dim=-1)


def _logprobs(
    lp: torch.Tensor | None, token_ids: torch.Tensor, ids: list[int], options: list[SamplingParams]
) -> list[PositionLogprobs | None]:
    """Logprobs from `lp` (_raw_logprobs), only for rows that asked."""
    out: list[PositionLogprobs | None] = [None] * len(options)
    if lp is None:
        return out
    rows = [i for i, o in enumerate(options) if o.logprobs is not None]
    idx = torch.tensor(rows, device=lp.device)
    sampled = lp.gather(1, token_ids[idx][:, None]).squeeze(1).tolist()
    n_top = max(options[i].logprobs or 0 for i in rows)
    top_vals: list[list[float]] = [[] for _ in rows]
    top_ids: list[list[int]] = [[] for _ in rows]
    if n_top:
        vals, tids = torch.topk(lp, min(n_top, lp.shape[-1]), dim=-1)  # sorted, most likely first
        top_vals, top_ids = vals.tolist(), tids.tolist()
    for j, i in enumerate(rows):
        n = options[i].logprobs or 0
        top = tuple(TokenLogprob(t, v) for t, v in zip(top_ids[j][:n], top_vals[j][:n]))
        out[i] = PositionLogprobs(TokenLogprob(ids[i], sampled[j]), top)
    return out
