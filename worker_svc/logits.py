"""Logits processing before sampling: penalties, logit_bias, allowed_token_ids, min_tokens, bad words, then
structured-output bitmasks."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from pagedserve_common.sampling import SamplingParams

NEG_INF = float("-inf")


def needs_processing(sp: SamplingParams) -> bool:
    """Whether a sequence's logits are ever touched before sampling (its bitmasks aside): fixed at admission, so
    the common case costs one attribute read a row a step."""
    return sp.needs_processing


def bitmask_num_bytes(vocab_size: int) -> int:
    """A token bitmask's exact length: ceil(vocab / 32) little-endian uint32 words."""
    return 4 * -(-vocab_size // 32)


def unpack_bitmasks(bitmasks: Sequence[bytes], vocab_size: int, invert: bool = False) -> np.ndarray:
    """[len(bitmasks), vocab_size] bools, True where allowed (where refused with `invert`): bit i of word j
    (little-endian uint32) allows token 32 * j + i, which is bit (i % 8) of byte 4 * j + i // 8, numpy's little bit
    order over the bytes as they are."""
    packed = np.frombuffer(b"".join(bitmasks), dtype=np.uint8).reshape(len(bitmasks), -1)
    if invert:
        packed = np.invert(packed)
    return np.unpackbits(packed, axis=1, count=vocab_size, bitorder="little").view(bool)


def allows_any(bitmask: bytes, vocab_size: int) -> bool:
    """Whether a bitmask allows at least one token below vocab_size (its padding bits do not count)."""
    full, rest = divmod(vocab_size, 8)
    view = np.frombuffer(bitmask, dtype=np.uint8)
    return bool(view[:full].any()) or bool(rest and int(view[full]) & ((1 << rest) - 1))


class _Grow:
    """An int64/float32 numpy array appended to in amortised O(1); `view` is its filled part."""

    __slots__ = ("data", "size")

    def __init__(self, dtype) -> None:
        self.data = np.empty(16, dtype=dtype)
        self.size = 0

    def append(self, value) -> int:
        if self.size == len(self.data):
            self.data = np.concatenate([self.data, np.empty_like(self.data)])
        self.data[self.size] = value
        self.size += 1
        return self.size - 1

    @property
    def view(self) -> np.ndarray:
        return self.data[:self.size]


class TokenCounts:
    """One sequence's tokens for the penalties, kept incrementally and sparse (a step touches only the tokens that
    occurred, never a whole vocabulary row): `seen_ids`, each token of the prompt or the outputs once (repetition);
    `output_ids` with `output_counts`, each output token once with its count (presence/frequency). The first
    update counts the whole sequence; later ones the tokens appended since (usually the one sampled last step)."""

    __slots__ = ("_seen", "seen_ids", "_slots", "output_ids", "output_counts", "num_counted")

    def __init__(self) -> None:
        self._seen: set[int] = set()
        self.seen_ids = _Grow(np.int64)
        self._slots: dict[int, int] = {}  # output token -> its index in output_ids/output_counts
        self.output_ids = _Grow(np.int64)
        self.output_counts = _Grow(np.float32)
        self.num_counted = 0

    def update(self, token_ids: list[int], num_prompt_tokens: int) -> None:
        seen, slots, counts = self._seen, self._slots, self.output_counts
        for pos in range(self.num_counted, len(token_ids)):
            t = token_ids[pos]
            if t not in seen:
                seen.add(t)
                self.seen_ids.append(t)
            if pos >= num_prompt_tokens:
                slot = slots.get(t)
                if slot is None:
                    slots[t] = self.output_ids.append(t)
                    counts.append(1.0)
                else:
                    counts.data[slot] += 1.0
        self.num_counted = len(token_ids)


class LogitsProcessor:
    """Applies each row's rules to its logits in place, batch-wide over the rows that have any, in this order:
    repetition penalty (CTRL's: a positive logit of a token seen in the prompt or outputs is divided by it, a
    negative one multiplied), presence and frequency penalties (outputs only), logit_bias, then the masks (-inf):
    allowed_token_ids' (every token off the list), min_tokens' stop ids (EOS unless ignore_eos, and stop_token_ids)
    while outputs < min_tokens, and bad words' last tokens whose prefix ends the output. Where those two would leave
    an allow-listed row no finite logit, bad words' masks give way there (then min_tokens', for a plan the front end
    did not check): the list is the client's hard limit. The structured-output bitmask comes last and wins: a row
    those masks would leave no finite logit within its bitmask samples from its raw logits under the bitmask alone.

    NOTE: every rule but the allow-list and the bitmask touches only a few entries a row (the tokens that occurred,
    the biased ids, the masked ids): gathered and scattered through flat indices, so a step costs what its rows'
    rules name; the two masks pass over their own rows only. The raw values overwritten are kept (sparse; a whole
    row only for an allow-listed row with a bitmask) for the bitmask's fallback. Rows with nothing to do cost one
    attribute read."""

    def __init__(self, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)

    def __call__(self, logits: torch.Tensor, seqs: Sequence, bitmasks: Mapping[int, bytes]) -> None:
        """Processes `logits` [B, V] (float32, contiguous) in place; `seqs[i]` is the SeqState of row i, `bitmasks`
        seq_id -> its bitmask this step (check_plan checked them)."""
        rows = [i for i, s in enumerate(seqs) if s.processed]
        if not rows and not bitmasks:  # NOTE: the common case
            return
        v = logits.shape[1]
        flat = logits.view(-1)
        saved: list[tuple[torch.Tensor, torch.Tensor]] = []  # (flat indices, the raw values there), in order
        if rows:
            self._apply_rules(flat, v, [seqs[i] for i in rows], rows, saved, bitmasks)
        if bitmasks:
            masked = [i for i, s in enumerate(seqs) if s.seq_id in bitmasks]
            self._apply_bitmasks(logits, masked, [bitmasks[seqs[i].seq_id] for i in masked], saved)

    def _apply_rules(self, flat: torch.Tensor, v: int, seqs: list, rows: list[int],
                     saved: list[tuple[torch.Tensor, torch.Tensor]], bitmasks: Mapping[int, bytes]) -> None:
        dev = flat.device
        counted = [(r, s) for r, s in zip(rows, seqs) if s.sampling.needs_token_counts]
        if counted:
            self._penalise(flat, v, counted, saved)
        bias_rows = [(r, s) for r, s in zip(rows, seqs) if s.sampling.logit_bias]
        if bias_rows:
            idx = torch.cat([s.logit_bias_tensors(dev)[0] + r * v for r, s in bias_rows])
            saved.append((idx, flat[idx]))
            flat.index_add_(0, idx, torch.cat([s.logit_bias_tensors(dev)[1] for _, s in bias_rows]))
        allowed = [(r, s) for r, s in zip(rows, seqs) if s.sampling.allowed_token_ids]
        if allowed:
            _allow_only(flat.view(-1, v), allowed, saved, bitmasks)
        stops: list[int] = []  # min_tokens' flat indices
        words: list[int] = []  # bad words'
        for r, s in zip(rows, seqs):
            sp, base = s.sampling, r * v
            num_outputs = len(s.token_ids) - s.num_prompt_tokens
            if num_outputs < sp.min_tokens:
                stop_ids = sp.stop_token_ids if sp.ignore_eos else (*self.eos_token_ids, *sp.stop_token_ids)
                stops.extend(base + t for t in stop_ids if 0 <= t < v)
            if sp.bad_words_token_ids:
                tokens = s.token_ids
                last = tokens[-1]
                for seq in sp.bad_words_token_ids:
                    n = len(seq) - 1
                    # NOTE: the last token first: most sequences fail there, without a slice
                    if n == 0 or (n <= num_outputs and seq[n - 1] == last
                                  and tokens[len(tokens) - n:] == list(seq[:n])):
                        if 0 <= seq[-1] < v:
                            words.append(base + seq[-1])
        # NOTE: a row without a bitmask or an allow-list keeps a finite logit: these masks name far fewer ids than a
        # vocabulary (the front end's limits), and a model's own logits are finite.
        masked = [(ids, *_mask(flat, ids, saved)) for ids in (stops, words) if ids]
        if allowed and masked:
            # an allow-list these masks left empty: bad words' give way first, then min_tokens' (only in a plan the
            # front end did not check: it refuses a list of stop ids alone with min_tokens, so the scheduler's check,
            # no stop id before min_tokens, holds)
            allowed_rows = {r for r, _ in allowed}
            for ids, idx, values in reversed(masked):
                _unban_emptied(flat, v, ids, idx, values, allowed_rows)

    def _penalise(self, flat: torch.Tensor, v: int, counted: list,
                  saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        dev = flat.device
        for _, s in counted:
            if s.counts is None:
                s.counts = TokenCounts()
            s.counts.update(s.token_ids, s.num_prompt_tokens)
        rep = [(r, s) for r, s in counted if s.sampling.repetition_penalty != 1.0]
        if rep:
            ids = [s.counts.seen_ids.view for _, s in rep]
            idx = _flat_index(ids, [r for r, _ in rep], v, dev)
            p = _per_entry([s.sampling.repetition_penalty for _, s in rep], ids, dev)
            x = flat[idx]
            saved.append((idx, x))
            flat[idx] = torch.where(x > 0, x / p, x * p)
        pf = [(r, s) for r, s in counted if s.sampling.presence_penalty or s.sampling.frequency_penalty]
        if pf:
            ids = [s.counts.output_ids.view for _, s in pf]
            idx = _flat_index(ids, [r for r, _ in pf], v, dev)
            counts = torch.from_numpy(np.concatenate([s.counts.output_counts.view for _, s in pf])).to(dev)
            freq = _per_entry([s.sampling.frequency_penalty for _, s in pf], ids, dev)
            pres = _per_entry([s.sampling.presence_penalty for _, s in pf], ids, dev)
            saved.append((idx, flat[idx]))
            flat.index_add_(0, idx, -(counts * freq + pres))  # NOTE: each index once: a row lists a token once

    def _apply_bitmasks(self, logits: torch.Tensor, rows: list[int], bitmasks: list[bytes],
                        saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        b, v = logits.shape
        dev = logits.device
        refused = _refused(bitmasks, v, dev)
        if len(rows) == b:  # NOTE: every row constrained (a structured-output workload): no gather, no scatter
            x = logits.masked_fill_(refused, NEG_INF)
        else:
            idx = torch.tensor(rows, device=dev)
            x = logits[idx].masked_fill_(refused, NEG_INF)
        empty = (x.amax(dim=-1) == NEG_INF).nonzero().flatten().tolist()
        if empty:  # the other masks left nothing the bitmask allows: the bitmask alone decides
            for j in empty:
                _restore_row(logits, rows[j], saved)
                row = logits[rows[j]].masked_fill(refused[j], NEG_INF)
                if not torch.isfinite(row).any():  # NOTE: a model whose own logits are -inf wherever it allows
                    row = torch.zeros_like(row).masked_fill_(refused[j], NEG_INF)
                x[j] = row
        if len(rows) != b:
            logits[idx] = x


def _allow_only(logits: torch.Tensor, allowed: list, saved: list[tuple[torch.Tensor, torch.Tensor]],
                bitmasks: Mapping[int, bytes]) -> None:
    """-inf off each (row, seq)'s allow-list, batch-wide over those rows through each sequence's cached mask. A row
    with a bitmask this step keeps its whole row's values in `saved` (the bitmask's fallback restores them)."""
    v, dev = logits.shape[1], logits.device
    idx = torch.tensor([r for r, _ in allowed], device=dev)
    x = logits[idx]
    for j, (r, s) in enumerate(allowed):
        if s.seq_id in bitmasks:
            saved.append((torch.arange(r * v, (r + 1) * v, device=dev), x[j].clone()))
    logits[idx] = x.masked_fill_(torch.stack([s.refused_tokens(dev, v) for _, s in allowed]), NEG_INF)


def _mask(flat: torch.Tensor, ids: list[int],
          saved: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """-inf at the flat indices `ids`; returns (their index tensor, the values there before), also kept in `saved`."""
    idx = torch.tensor(ids, dtype=torch.long, device=flat.device)
    values = flat[idx]
    saved.append((idx, values))
    flat[idx] = NEG_INF
    return idx, values


def _unban_emptied(flat: torch.Tensor, v: int, banned: list[int], idx: torch.Tensor, values: torch.Tensor,
                   allowed_rows: set[int]) -> None:
    """Puts back one mask's entries (`banned`, as `idx`, with their `values` before) in each allow-listed row it
    left with no finite logit."""
    rows = sorted({b // v for b in banned} & allowed_rows)
    if not rows:
        return
    dev = flat.device
    hit = torch.tensor(rows, device=dev)
    empty = hit[flat.view(-1, v)[hit].amax(dim=-1) == NEG_INF]
    if len(empty):
        mine = torch.isin(idx // v, empty)
        flat[idx[mine]] = values[mine]


def _refused(bitmasks: list[bytes], v: int, dev) -> torch.Tensor:
    """[rows, v] bools, True where a bitmask refuses. NOTE: on an accelerator the packed words travel (1 bit a
    token) and are unpacked there, not 8 bits a token over the bus."""
    if dev.type == "cpu":
        return torch.from_numpy(unpack_bitmasks(bitmasks, v, invert=True))
    return refused_on_device(bitmasks, v, dev)


def refused_on_device(bitmasks: list[bytes], v: int, dev) -> torch.Tensor:
    """_refused with torch ops on `dev`: the packed bytes go over, each becomes its 8 bits (little order) there."""
    packed = torch.frombuffer(bytearray(b"".join(bitmasks)), dtype=torch.uint8).view(len(bitmasks), -1).to(dev)
    shifts = torch.arange(8, dtype=torch.uint8, device=dev)
    bits = (packed[:, :, None] >> shifts).bitwise_and_(1).view(len(bitmasks), -1)[:, :v]
    return bits == 0


def _flat_index(ids: list[np.ndarray], rows: list[int], v: int, dev) -> torch.Tensor:
    offsets = np.repeat(np.asarray(rows, dtype=np.int64) * v, [len(a) for a in ids])
    return torch.from_numpy(np.concatenate(ids) + offsets).to(dev)


def _per_entry(values: list[float], ids: list[np.ndarray], dev) -> torch.Tensor:
    """Each row's value repeated once per entry of that row's ids."""
    return torch.from_numpy(np.repeat(np.asarray(values, dtype=np.float32), [len(a) for a in ids])).to(dev)


def _restore_row(logits: torch.Tensor, row: int, saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Puts back row `row`'s raw logits where the rules overwrote them (the earliest saved value is the raw one)."""
    v, flat = logits.shape[1], logits.view(-1)
    for idx, values in reversed(saved):
        mine = (idx // v) == row
        if mine.any():
            flat[idx[mine]] = values[mine]
