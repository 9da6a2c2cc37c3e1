"""Per-step token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds and logprobs."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from scheduler_svc.core.request import check_sampling_ranges
# Slack for float32 rounding in the nucleus cumsum: without it, a crafted distribution whose head sums to
# exactly top_p (0.5 + 0.3 vs 0.8) keeps one extra token or not depending on the rounding direction.
TOP_P_EPS = 1e-6


@dataclass(slots=True)
class SamplingOptions:
    """Sampling settings of one request; temperature 0 means greedy."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    seed: int | None = None
    logprobs: int | None = None  # None = none; 0 = the sampled token's only; N = also the top N

    def validate(self) -> None:
        check_sampling_ranges(self.temperature, self.top_p, self.top_k, self.min_p, self.logprobs)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(slots=True)
class LogprobEntry:
    """The sampled token's logprob and the top-N alternatives, most likely first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(slots=True)
class SampleOutput:
    """One sampled token per row, plus logprobs for the rows that asked for them."""

    token_ids: list[int]
    logprobs: list[LogprobEntry | None]


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator for one seeded request; the worker creates it once and passes it every step."""
    g = torch.Generator(device=device)
    # Reduce modulo 2**64 so any Python int (negative, huge) is a valid seed and maps deterministically.
    g.manual_seed(seed % (1 << 64))
    return g


class Sampler:
    """Turns a batch of last-position logits into next tokens.

    Logprobs are those of the model's raw distribution, log_softmax of the logits before temperature,
    top-k, top-p and min-p (vLLM's default), so they do not depend on the sampling settings.
    """

    def sample(
        self,
        logits: torch.Tensor,
        options: list[SamplingOptions],
        generators: list[torch.Generator | None],
    ) -> SampleOutput:
        # NOTE: options are validated once on admission (the scheduler's SamplingConfig.validate), not every step.
        if logits.dim() != 2:
            raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}")
        b = logits.shape[0]
        if len(options) != b or len(generators) != b:
            raise ValueError(f"batch of {b} rows but {len(options)} options and {len(generators)} generators")
        logits = logits.float()
        token_ids = torch.empty(b, dtype=torch.long, device=logits.device)

        greedy = [i for i, o in enumerate(options) if o.greedy]
        if greedy:
            idx = torch.tensor(greedy, device=logits.device)
            token_ids[idx] = logits[idx].argmax(dim=-1)  # ties -> lowest id, as transformers' greedy does
        random_rows = [i for i, o in enumerate(options) if not o.greedy]
        if random_rows:
            idx = torch.tensor(random_rows, device=logits.device)
            probs = _filtered_probs(logits[idx], [options[i] for i in random_rows])
            token_ids[idx] = _draw(probs, [generators[i] for i in random_rows])

        ids = token_ids.tolist()
        return SampleOutput(token_ids=ids, logprobs=_logprobs(logits, token_ids, ids, options))


def _filtered_probs(logits: torch.Tensor, options: list[SamplingOptions]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p as masks over one batched sort; returns probabilities."""
    n, v = logits.shape
    dev = logits.device
    temp = torch.tensor([o.temperature for o in options], dtype=torch.float32, device=dev)
    x = logits / temp[:, None]
    if all(o.top_k == 0 and o.top_p >= 1 and o.min_p == 0 for o in options):
        return torch.softmax(x, dim=-1)  # nothing to filter: skip the sort

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


def _draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row by the exponential race argmax(p / Exp(1)), which samples exactly from p.

    NOTE: a seeded row's noise comes only from its own generator, V draws per step in vocab order, so its
    tokens do not depend on batch size, row position or the other rows.
    """
    n, v = probs.shape
    noise = torch.empty_like(probs)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        idx = torch.tensor(unseeded, device=probs.device)
        noise[idx] = torch.empty(len(unseeded), v, device=probs.device).exponential_()
    for i, g in enumerate(generators):
        if g is not None:
            # Drawn on the generator's own device, so a CPU generator gives the same stream on any device.
            noise[i] = torch.empty(v, device=g.device).exponential_(generator=g).to(probs.device)
    # A zero draw means "arrives first"; clamping keeps 0/0 from making NaN on masked tokens.
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    return (probs / noise).argmax(dim=-1)


def _logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, ids: list[int], options: list[SamplingOptions]
) -> list[LogprobEntry | None]:
    """Logprobs from log_softmax of the raw logits, only for rows that asked."""
    out: list[LogprobEntry | None] = [None] * len(options)
    rows = [i for i, o in enumerate(options) if o.logprobs is not None]
    if not rows:
        return out
    idx = torch.tensor(rows, device=logits.device)
    lp = torch.log_softmax(logits[idx], dim=-1)
    sampled = lp.gather(1, token_ids[idx][:, None]).squeeze(1).tolist()
    n_top = max(options[i].logprobs or 0 for i in rows)
    top_vals: list[list[float]] = [[] for _ in rows]
    top_ids: list[list[int]] = [[] for _ in rows]
    if n_top:
        vals, tids = torch.topk(lp, min(n_top, lp.shape[-1]), dim=-1)  # sorted, most likely first
        top_vals, top_ids = vals.tolist(), tids.tolist()
    for j, i in enumerate(rows):
        n = options[i].logprobs or 0
        top = list(zip(top_ids[j][:n], top_vals[j][:n]))
        out[i] = LogprobEntry(token_id=ids[i], logprob=sampled[j], top=top)
    return out
