"""StructuredOutput specs to llguidance grammars: compiled on a thread pool, bounded in size, work and time, cached."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from pagedserve_common.sampling import InvalidField, StructuredOutput
from scheduler_svc import json_text
from scheduler_svc.errors import EngineError, ErrorCode
from scheduler_svc.structured.matcher import Grammar

if TYPE_CHECKING:
    import llguidance

FIELD = "structured_output"
COMPILE_TIMEOUT_SECONDS = 10.0  # a compile (queued on the pool included) that takes longer is refused
NUM_COMPILE_THREADS = 2  # NOTE: llguidance drops the GIL while it builds a grammar: the event loop keeps running
CACHE_SIZE = 256  # compiled specs kept (least recently used dropped); a refused spec is remembered too
MAX_PENDING = 64  # compiles queued or running at once; one more request is RESOURCE_EXHAUSTED
MAX_ERROR_CHARS = 400
# The most one token mask of a grammar may cost, measured on its first mask at compile time: a grammar beyond it is
# refused. NOTE: measured here (a 2-core Xeon, a 49k vocabulary): a JSON schema's mask 0.2 ms, a regex's 0.01 ms;
# `x{65535}` 59 ms, `a{1000000}` 221 ms, `a{1000}{1000}` 518 ms, each step (48 such requests froze the event loop
# for 13.6 s). 10 ms leaves 50x a schema's cost for a busy machine and a large vocabulary.
MASK_BUDGET_SECONDS = 0.010
CLEARLY_OVER = 10
# NOTE: compact JSON (no whitespace between tokens, "," and ":" separators): a small model given the freedom of
# whitespace can loop on newlines until max_tokens; the output is still JSON any parser reads.
JSON_OPTIONS = {"whitespace_flexible": False}
# The engine's bounds on one grammar's work (llguidance's defaults, written out so that they are ours): the size of
# the grammar, the fuel of building its lexer, and the work of computing one step's mask. Beyond them the compile
# fails (INVALID_ARGUMENT) or, mid-output, the sample ends (Constraint.failed).
LIMITS = dict(max_grammar_size=500_000, initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000,
              step_max_items=50_000, max_items_in_row=2_000, max_lexer_states=250_000)


def grammar_text(so: StructuredOutput) -> str:
    """The llguidance grammar (its JSON form) of a spec; raises InvalidField naming structured_output when the
    spec is malformed before any compiling (not JSON, not a JSON object schema)."""
    import llguidance  # NOTE: at the first structured output, not at start (matcher.py says why)

    so.validate()
    kind = so.kind
    if kind == "json_schema":
        try:
            schema = json_text.loads(so.spec)
        except json_text.TooDeep as e:
            raise InvalidField(FIELD, f"{FIELD}.json_schema: {e}") from None
        except ValueError as e:
            raise InvalidField(FIELD, f"{FIELD}.json_schema is not JSON: {e}") from None
        if not isinstance(schema, dict):
            raise InvalidField(FIELD, f"{FIELD}.json_schema must be a JSON object, got {type(schema).__name__}")
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        except ValueError as e:
            raise InvalidField(FIELD, f"{FIELD}.json_schema: {_short(str(e))}") from None
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(ascii_classes(so.spec))
    if kind == "choice":
        # NOTE: JSON string literals are Lark's too; so any character of a choice stands for itself
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in so.choices))
    from llguidance.gbnf_to_lark import any_to_lark

    try:  # grammar: Lark (llguidance's dialect), or GBNF (llama.cpp's, as vLLM clients also send), converted
        return llguidance.LLMatcher.grammar_from_lark(any_to_lark(so.spec))
    except Exception as e:  # noqa: BLE001 - the converter raises whatever a malformed GBNF grammar trips
        raise InvalidField(FIELD, f"{FIELD}.grammar is neither Lark nor GBNF: {_short(str(e))}") from None


# NOTE: Rust's regex (llguidance's) reads \d and \w as Unicode classes (a model then writes digits of other scripts);
# clients of vLLM's guided_regex (its engines) and JSON Schema's patterns mean ASCII ones.
_ASCII_CLASSES = {"d": "0-9", "w": "0-9A-Za-z_"}


def ascii_classes(pattern: str) -> str:
    r"""`pattern` with \d and \w spelled as their ASCII ranges, inside character classes and out."""
    out, i, depth = [], 0, 0
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\" and i + 1 < len(pattern):
            nxt = pattern[i + 1]
            if nxt in _ASCII_CLASSES:
                out.append(_ASCII_CLASSES[nxt] if depth else f"[{_ASCII_CLASSES[nxt]}]")
            else:
                out.append(pattern[i:i + 2])
            i += 2
            continue
        if ch == "[":
            depth += 1
        elif ch == "]" and depth:
            depth -= 1
        out.append(ch)
        i += 1
    return "".join(out)


def mask_cost(matcher: llguidance.LLMatcher, first: float) -> float:
    """Seconds one token mask of `matcher`'s grammar takes, its first mask having taken `first` (that one also
    builds the lexer's start, so it costs at least as much as any): the cheaper of up to two more computed on copies
    (NOTE: the cheaper one: a moment of a busy machine must not refuse a grammar that is cheap; none when the first
    was within the budget, one when it costs CLEARLY_OVER times the budget: noise is not that)."""
    cost = first
    for _ in range(2):
        if cost <= MASK_BUDGET_SECONDS or cost > CLEARLY_OVER * MASK_BUDGET_SECONDS:
            break
        copy = matcher.deep_copy()
        start = time.perf_counter()
        copy.compute_bitmask()
        cost = min(cost, time.perf_counter() - start)
    return cost


def _short(text: str) -> str:
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS] + "..."


class GrammarCompiler:
    """Compiles specs for one model's tokenizer, off the event loop: each on a small thread pool, within
    COMPILE_TIMEOUT_SECONDS and LIMITS, at most MAX_PENDING at once; the last CACHE_SIZE outcomes (grammars and
    refusals) kept by spec."""

    def __init__(self, tokenizer_json: str | Callable[[], str], vocab_size: int, eos_token_ids: Sequence[int],
                 timeout: float = COMPILE_TIMEOUT_SECONDS, cache_size: int = CACHE_SIZE,
                 max_pending: int = MAX_PENDING) -> None:
        """`tokenizer_json`: tokenizer.json's text, or what makes it (called once, on a pool thread: ~60 ms for a
        49k vocabulary)."""
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.timeout = timeout
        self.cache_size = cache_size
        self.max_pending = max_pending
        self.num_pending = 0  # NOTE: on the event loop only (each job's end is told to it: _done)
        self._cache: OrderedDict[StructuredOutput, Grammar | InvalidField] = OrderedDict()
        # NOTE: at the serving's own CPU priority: a lower one (nice 19) starved every compile past its timeout on a
        # busy host (a simple regex took over 10 s beside a busy loop)
        self._pool = ThreadPoolExecutor(NUM_COMPILE_THREADS, thread_name_prefix="grammar")
        self._jobs: dict[StructuredOutput, asyncio.Future] = {}  # compiles under way: one per spec
        self._lltok: llguidance.LLTokenizer | None = None
        self._lltok_lock = threading.Lock()
        self.num_compiled = 0  # compiles run (cache misses), for tests and metrics

    async def compile(self, so: StructuredOutput) -> Grammar:
        """The spec's grammar; raises InvalidField naming structured_output when it does not compile (in time), or
        EngineError(RESOURCE_EXHAUSTED) when MAX_PENDING compiles are under way already."""
        hit = self._cache.get(so)
        if hit is None:
            # NOTE: one compile per spec at a time: the same costly spec sent 48 times at once is compiled once
            job = self._jobs.get(so) or self._start(so)
            try:
                hit = await asyncio.wait_for(asyncio.shield(job), self.timeout)
            except TimeoutError:
                # NOTE: the thread runs on to its end (LIMITS bound it), and its outcome is then cached (_done)
                raise InvalidField(FIELD, f"{FIELD}: compiling the {so.kind} took over {self.timeout:g} s") from None
        else:
            self._cache.move_to_end(so)
        if isinstance(hit, InvalidField):
            raise InvalidField(hit.field, str(hit))
        return hit

    def _start(self, so: StructuredOutput) -> asyncio.Future:
        if self.num_pending >= self.max_pending:
            raise EngineError(ErrorCode.RESOURCE_EXHAUSTED, f"{self.num_pending} structured output specs are "
                                                            "being compiled already; retry later")
        self.num_pending += 1
        job = self._jobs[so] = asyncio.get_running_loop().run_in_executor(self._pool, self._compile, so)
        # NOTE: the count drops and the outcome is kept when the work ends, not when a caller stops waiting
        job.add_done_callback(lambda done: self._done(so, done))
        return job

    def _done(self, so: StructuredOutput, job: asyncio.Future) -> None:
        self.num_pending -= 1
        del self._jobs[so]
        if job.cancelled() or job.exception() is not None:
            return
        self._cache[so] = job.result()
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)

    def _tokenizer(self) -> llguidance.LLTokenizer:
        with self._lltok_lock:  # NOTE: built once, at the first compile (~0.25 s for a 49k vocabulary)
            if self._lltok is None:
                import llguidance

                text = self._tokenizer_json() if callable(self._tokenizer_json) else self._tokenizer_json
                self._lltok = llguidance.LLTokenizer(text, n_vocab=self.vocab_size,
                                                     eos_token=self.eos_token_ids or None)
            return self._lltok

    def _compile(self, so: StructuredOutput) -> Grammar | InvalidField:
        """On a pool thread: the grammar, or why not (returned, so that the refusal is cached like a grammar)."""
        self.num_compiled += 1
        try:
            text = grammar_text(so)
        except InvalidField as e:
            return e
        import llguidance

        tok = self._tokenizer()
        matcher = llguidance.LLMatcher(tok, text, log_level=0, limits=llguidance.LLParserLimits(**LIMITS))
        first = 0.0
        if not matcher.is_error():
            start = time.perf_counter()
            matcher.compute_bitmask()  # NOTE: the first mask builds the lexer's start: here, not on the event loop
            first = time.perf_counter() - start
        if matcher.is_error():
            return InvalidField(FIELD, f"{FIELD}: the {so.kind} does not compile: {_short(matcher.get_error())}")
        if (cost := mask_cost(matcher, first)) > MASK_BUDGET_SECONDS:
            return InvalidField(FIELD, f"{FIELD}: the {so.kind} costs {cost * 1e3:.0f} ms per token to follow; at "
                                       f"most {MASK_BUDGET_SECONDS * 1e3:g} ms are allowed (a simpler one, e.g. "
                                       f"without nested or huge repetition counts)")
        eos = self.eos_token_ids[0] if self.eos_token_ids else tok.eos_token
        return Grammar(matcher, self.vocab_size, eos)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
