"""Seeded benchmark workloads: every request is a prompt (token ids or text) and a number of output tokens."""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

WORKLOADS = ("mixed", "shared-prefix", "multi-tenant", "edit", "chat")
DEFAULT_NUM_REQUESTS = 64  # --num-requests of a synthetic workload
DEFAULT_TURN_LEN = (32, 96)  # --prompt-len of a user turn (shared-prefix, multi-tenant, chat)

# Plain English written for this file; prompts are cut from it, sentence order shuffled by the seed.
_TEXT = """\
The old harbor town wakes up slowly on winter mornings. Fishing boats leave before the sun rises, and by the
time the bakery opens its doors the water is already busy with gulls. Children walk to school along the sea
wall, counting the boats they can still see on the horizon. Most of the houses are painted in bright colors,
which makes the streets look cheerful even when the sky is grey. An old lighthouse stands at the end of the
pier, although it has not guided a ship for many years.
A good library is more than a room full of books. It is a quiet place where people of every age can follow
their curiosity without being asked to pay or to explain themselves. Some visitors come to read the news,
others to study for an exam, and a few simply come to sit somewhere warm. The librarians know many of them by
name and remember which stories they liked last time. When the building closes in the evening, the lights go
off one floor at a time.
Learning to cook is mostly a matter of patience and attention. A sauce that is rushed will burn, while one
that is left alone for too long will turn thick and bitter. Fresh vegetables need very little help, just some
salt, a little oil and a hot pan. Bread teaches a different lesson, because the dough decides when it is
ready and the baker has to wait. Over time a cook learns to trust the smell of the kitchen more than the
clock on the wall.
The mountain trail begins in a forest of tall pines and climbs steadily toward a wide ridge. Hikers who start
early can reach the first lake before noon and rest on the flat rocks near the shore. Higher up, the trees
give way to grass, wild flowers and patches of snow that last well into summer. The view from the top covers
three valleys and, on a clear day, the distant line of the sea. Coming down always takes longer than people
expect, because tired legs make every step more careful.
Small gardens can feed a family for a surprising part of the year. Beans and tomatoes grow quickly in the warm
months, and a row of lettuce can be picked again and again. Compost made from kitchen scraps keeps the soil
rich without any need for expensive products. Neighbors often trade what they have too much of, so a
basket of apples might come back as a jar of honey. In the autumn the beds are covered with leaves to protect
them from the frost.
Trains connect the cities of the plain like beads on a long string. The morning service is crowded with
students and office workers, most of them reading or looking at their phones. In the afternoon the carriages
are calmer, and travelers watch the fields and small villages pass by the window. A conductor walks through
every car to check tickets and answer questions about connections. At night the last train arrives almost
empty, its lights shining across the wet platform.
Music has a way of bringing strangers together. In the square near the market a group of musicians plays every
Saturday, and people stop to listen on their way home. Some of them tap their feet, some sing along, and a few
of the older couples start to dance. The players do not ask for much, only a coin in the open guitar case or
a friendly word. When the sun goes down they pack their instruments and promise to return next week.
"""


class TokenizerLike(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


@dataclass(slots=True, frozen=True)
class BenchRequest:
    """One request of a workload: exactly one of prompt_token_ids and prompt is set."""

    max_tokens: int
    prompt_token_ids: tuple[int, ...] | None = None
    prompt: str | None = None

    @property
    def prompt_len(self) -> int | None:
        return None if self.prompt_token_ids is None else len(self.prompt_token_ids)

    def to_json(self) -> dict:
        if self.prompt_token_ids is not None:
            return {"prompt_token_ids": list(self.prompt_token_ids), "max_tokens": self.max_tokens}
        return {"prompt": self.prompt, "max_tokens": self.max_tokens}


def parse_range(spec: str) -> tuple[int, int]:
    """'MIN:MAX' (inclusive, 1 <= MIN <= MAX) as a pair."""
    try:
        lo, hi = (int(x) for x in spec.split(":"))
    except ValueError:
        raise ValueError(f"expected MIN:MAX, got {spec!r}") from None
    if not 1 <= lo <= hi:
        raise ValueError(f"expected 1 <= MIN <= MAX, got {spec!r}")
    return lo, hi


def format_range(lengths: tuple[int, int]) -> str:
    """A pair as 'MIN:MAX' (parse_range's inverse)."""
    return f"{lengths[0]}:{lengths[1]}"


class TextSource:
    """The built-in text as token ids, one list per sentence, for cutting prompts of exact lengths."""

    def __init__(self, tokenizer: TokenizerLike) -> None:
        sentences = [s.strip() + "." for s in " ".join(_TEXT.split()).split(".") if s.strip()]
        # A leading space keeps each word's usual mid-text token when sentences are joined.
        self.sentences = [tokenizer.encode(" " + s, add_special_tokens=False) for s in sentences]

    def take(self, rng: random.Random, n: int) -> list[int]:
        """`n` token ids: shuffled sentences, starting at a random token of the first so prompts rarely share
        a prefix by chance (that would inflate prefix-cache hits)."""
        out: list[int] = []
        first = True
        while len(out) < n:
            order = list(range(len(self.sentences)))
            rng.shuffle(order)
            for i in order:
                ids = self.sentences[i]
                out.extend(ids[rng.randrange(len(ids)):] if first else ids)
                first = False
                if len(out) >= n:
                    break
        return out[:n]


def _lengths(rng: random.Random, n: int, override: tuple[int, int] | None, median: float, sigma: float,
             lo: int, hi: int) -> list[int]:
    """Uniform in `override` when given, else lognormal (long-tailed, like ShareGPT) around `median`, clipped."""
    if override is not None:
        return [rng.randint(*override) for _ in range(n)]
    return [min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma)))) for _ in range(n)]


EDIT_INSTRUCTION = "Correct the spelling mistakes in the text below and write it out again in full, changing nothing else."


def _typos(rng: random.Random, text: str, rate: float = 0.08) -> str:
    """`text` with about `rate` of its longer words misspelt (two inner letters swapped)."""
    words = text.split(" ")
    for i, w in enumerate(words):
        if len(w) >= 5 and w.isalpha() and rng.random() < rate:
            j = rng.randrange(1, len(w) - 2)
            words[i] = w[:j] + w[j + 1] + w[j] + w[j + 2:]
    return " ".join(words)


def _edit_requests(rng: random.Random, tokenizer: TokenizerLike, num_requests: int,
                   prompt_len: tuple[int, int] | None, output_len: tuple[int, int] | None,
                   max_model_len: int) -> list[BenchRequest]:
    """edit: an instruction, then a passage of the built-in text (whole sentences, at least prompt_len tokens, default
    64:192, at most a third of max_model_len) with typos, then "Corrected text:": the answer is mostly the passage
    copied (what prompt lookup drafts well). Outputs: the passage's tokens + 8 (or uniform in output_len)."""
    sentences = [s.strip() + "." for s in " ".join(_TEXT.split()).split(".") if s.strip()]
    lo, hi = prompt_len or (64, 192)
    hi = max(1, min(hi, max_model_len // 3 - 64))
    lo = min(lo, hi)
    head = tokenizer.encode(f"{EDIT_INSTRUCTION}\n\nText:", add_special_tokens=False)
    out = []
    for _ in range(num_requests):
        want, start = rng.randint(lo, hi), rng.randrange(len(sentences))
        passage: list[str] = []
        while len(tokenizer.encode(" " + " ".join(passage), add_special_tokens=False)) < want:
            passage.append(sentences[(start + len(passage)) % len(sentences)])
        text = _typos(rng, " ".join(passage))
        body = tokenizer.encode(" " + text, add_special_tokens=False)
        tail = tokenizer.encode("\n\nCorrected text:", add_special_tokens=False)
        num_out = rng.randint(*output_len) if output_len else len(body) + 8
        out.append(BenchRequest(num_out, tuple(head + body + tail)))
    return out


def chat_requests(rng: random.Random, tokenizer, text: TextSource, outputs: list[int], turn_len: tuple[int, int],
                  system_len: int = 0) -> list[BenchRequest]:
    """One chat request a output length: a user turn of turn_len tokens of the built-in text through the model's
    chat template (`tokenizer.encode_chat`). Every prompt shares ONE system prefix: the template's default system
    prompt (24 tokens with SmolLM2's: one full block), or a system message of `system_len` tokens of the text. The
    case where a prefix every worker can hold must not pin all traffic to one worker (issue 48)."""
    system = tokenizer.decode(text.take(rng, system_len)) if system_len else None
    out = []
    for num_out in outputs:
        user = tokenizer.decode(text.take(rng, rng.randint(*turn_len))).strip()
        messages = [{"role": "system", "content": system}] if system else []
        out.append(BenchRequest(num_out, tuple(tokenizer.encode_chat([*messages, {"role": "user", "content": user}]))))
    return out


def build_workload(name: str, tokenizer: TokenizerLike, num_requests: int, seed: int = 0,
                   prompt_len: tuple[int, int] | None = None, output_len: tuple[int, int] | None = None,
                   num_tenants: int = 4, max_model_len: int = 2048) -> list[BenchRequest]:
    """The named synthetic workload; the same arguments give the same requests.

    mixed: prompts lognormal (median 96, clipped to [16, min(1024, max_model_len/2)]) or uniform in prompt_len.
    shared-prefix: one ~1,000-token system prompt for all, plus a user turn (prompt_len, default 32:96).
    multi-tenant: num_tenants distinct ~500-token system prompts, one picked per request, plus a user turn.
    Outputs: lognormal (median 64, clipped to [16, 256]) or uniform in output_len.
    edit: _edit_requests (speculative decoding's case: outputs that copy the prompt).
    chat: chat_requests (one user turn of prompt_len, default 32:96, through the chat template: every prompt shares
    the template's system prefix).
    """
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r} (expected one of {', '.join(WORKLOADS)} or a .jsonl file)")
    if num_requests < 1:
        raise ValueError("--num-requests must be at least 1")
    rng = random.Random(seed)
    if name == "edit":
        return _edit_requests(rng, tokenizer, num_requests, prompt_len, output_len, max_model_len)
    text = TextSource(tokenizer)
    outputs = _lengths(rng, num_requests, output_len, 64, 0.8, 16, 256)
    if name == "chat":
        return chat_requests(rng, tokenizer, text, outputs, prompt_len or DEFAULT_TURN_LEN)
    if name == "mixed":
        prompts = _lengths(rng, num_requests, prompt_len, 96, 1.0, 16, max(16, min(1024, max_model_len // 2)))
        return [BenchRequest(o, tuple(text.take(rng, p))) for p, o in zip(prompts, outputs)]
    turn_range = prompt_len or DEFAULT_TURN_LEN
    turns = [rng.randint(*turn_range) for _ in range(num_requests)]
    if name == "shared-prefix":
        systems = [text.take(rng, min(1000, max_model_len // 2))]
    else:
        if num_tenants < 1:
            raise ValueError("--num-tenants must be at least 1")
        systems = [text.take(rng, min(500, max_model_len // 2)) for _ in range(num_tenants)]
    picks = [rng.randrange(len(systems)) for _ in range(num_requests)]
    return [BenchRequest(o, tuple(systems[s] + text.take(rng, t))) for s, t, o in zip(picks, turns, outputs)]


def load_jsonl(path: str | Path, num_requests: int | None = None) -> list[BenchRequest]:
    """Requests from a JSONL file: each line has `prompt` (text) or `prompt_token_ids`, and `max_tokens`."""
    out: list[BenchRequest] = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict) or "max_tokens" not in row:
                raise ValueError("needs max_tokens")
            max_tokens = int(row["max_tokens"])
            if ("prompt" in row) == ("prompt_token_ids" in row):
                raise ValueError("needs exactly one of prompt and prompt_token_ids")
            if "prompt" in row:
                if not isinstance(row["prompt"], str):
                    raise ValueError("prompt must be a string")
                req = BenchRequest(max_tokens, prompt=row["prompt"])
            else:
                req = BenchRequest(max_tokens, tuple(int(t) for t in row["prompt_token_ids"]))
            if max_tokens < 1:
                raise ValueError("max_tokens must be at least 1")
        except (ValueError, TypeError) as e:
            raise ValueError(f"{path}:{n}: {e}") from None
        out.append(req)
        if num_requests is not None and len(out) == num_requests:
            break
    if not out:
        raise ValueError(f"{path}: no requests")
    return out


def dump_jsonl(requests: list[BenchRequest], path: str | Path) -> None:
    """Writes requests in the format load_jsonl reads, so a run can be replayed with --workload."""
    Path(path).write_text("".join(json.dumps(r.to_json()) + "\n" for r in requests), encoding="utf-8")


# -- what `pagedserve bench` runs ------------------------------------------------------------------------------
FALLBACK_MAX_MODEL_LEN = 2048  # when neither the model nor the server says


def _tokenizer_dir(args) -> str:
    if args.tokenizer:
        return args.tokenizer
    from pagedserve_cli.serve_cmd import model_dir
    from pagedserve_common.defaults import DEFAULT_MODEL

    return model_dir(DEFAULT_MODEL)


def _config_max_len(model_dir: str) -> int | None:
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return cfg.get("max_position_embeddings")


def build_requests(args, server_max_len: int | None) -> tuple[list, dict]:
    """The workload's requests, and what was resolved to build them (tokenizer dir, max_model_len)."""
    if args.workload not in WORKLOADS:
        if not Path(args.workload).is_file():
            raise ValueError(f"--workload {args.workload!r}: not one of {', '.join(WORKLOADS)} nor a file")
        return load_jsonl(args.workload, args.num_requests), {}
    from scheduler_svc.frontend.tokenizer import Tokenizer

    tok_dir = _tokenizer_dir(args)
    # The shorter of the model's and the server's limits, so that both peers of a comparison get the same bytes.
    lens = [n for n in (_config_max_len(tok_dir), server_max_len) if n]
    max_len = min(lens) if lens else FALLBACK_MAX_MODEL_LEN
    reqs = build_workload(args.workload, Tokenizer.from_model_dir(tok_dir), args.num_requests or DEFAULT_NUM_REQUESTS, args.seed,
                          args.prompt_len, args.output_len, args.num_tenants, max_len)
    return reqs, {"tokenizer": tok_dir, "max_model_len": max_len}
