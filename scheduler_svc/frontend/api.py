"""FrontEnd: turns one generation as a client API asks for it into an engine request and its stream."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Coroutine, Mapping
from typing import TYPE_CHECKING

import jinja2

from pagedserve_common.defaults import MAX_TENANT_CHARS, TENANT_HEADER
from pagedserve_common.sampling import InvalidField, SamplingParams
from pagedserve_common.registration import WorkerRegistration
from scheduler_svc.core.kv_snapshot import KVPoolSnapshot
from scheduler_svc.errors import DRAINING, EngineError, ErrorCode
from scheduler_svc.frontend.inputs import INPUTS, GenerateInput
from scheduler_svc.frontend.limits import Limits
from scheduler_svc.frontend.pool import TokenizerPool
from scheduler_svc.frontend.stream import RequestStream
from scheduler_svc.frontend.tokenizer import FinalMessageError, TemplateRefusal, Tokenizer
from scheduler_svc.identity import NO_KEYS, Identity
from scheduler_svc.structured.compiler import GrammarCompiler
from scheduler_svc.structured.matcher import Grammar

if TYPE_CHECKING:
    from scheduler_svc.engine import Engine
    from scheduler_svc.tracing.spans import RequestTrace, Tracing

def _wrapped(value: int) -> str:
    return " (a negative number sent as uint32?)" if value >= 2**31 else ""


def _check_allow_list(sp: SamplingParams, eos_token_ids: tuple[int, ...]) -> None:
    """A list of stop ids alone under min_tokens leaves nothing to sample before min_tokens (the worker masks them
    there): refused, so that neither rule is broken for the other (result_check holds a worker to min_tokens)."""
    if sp.allowed_token_ids and sp.min_tokens:
        stops = {*sp.stop_token_ids, *(() if sp.ignore_eos else eos_token_ids)}
        if stops.issuperset(sp.allowed_token_ids):
            raise InvalidField("allowed_token_ids", f"allowed_token_ids: every id listed ends a sample, which "
                                                    f"min_tokens ({sp.min_tokens}) forbids until then: list another "
                                                    "token too, or drop min_tokens")


def _template_failure(e: Exception) -> str:
    if isinstance(e, jinja2.UndefinedError):
        return "it reads a field a message does not have"
    if isinstance(e, TypeError):
        return "a value has a type it does not expect, e.g. content null"
    if isinstance(e, ValueError) and "no chat template" in str(e):
        return "the model has no chat template"
    return type(e).__name__


def invalid(field_name: str, message: str) -> EngineError:
    return EngineError(ErrorCode.INVALID_ARGUMENT, message, field_name)


def tenant_of(values: list[str], identity: Identity = NO_KEYS) -> str:
    """The tenant of a request from its caller's `identity` and its TENANT_HEADER `values` (HTTP header or gRPC
    metadata): the header's when the identity may name tenants (a gateway or operator key, or any caller of a
    server without keys), else (or with no header) the key's name ("" for an unnamed key: the shared tenant). More
    than one header value is INVALID_ARGUMENT naming it; a tenant key's header naming another tenant than its own is
    PERMISSION_DENIED (a tenant is an identity: a key's holder counts as the key's tenant only)."""
    if len(values) > 1:
        raise invalid(TENANT_HEADER, f"{TENANT_HEADER} is sent {len(values)} times: send it once")
    if not values:
        return identity.tenant
    if identity.names_tenants or values[0] == identity.tenant:
        return values[0]
    own = f"send {identity.tenant!r} or leave it out" if identity.tenant else "leave it out"
    raise EngineError(ErrorCode.PERMISSION_DENIED, f"{TENANT_HEADER}: this API key's requests count for its own "
                                                   f"tenant: {own} (only a key with role=gateway or role=operator "
                                                   f"names a tenant)", TENANT_HEADER)


class FrontEnd:
    """What the gRPC servicer and the HTTP app call: one validation, one tokenization, one stream type."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer, limits: Limits | None = None,
                 pool: TokenizerPool | None = None,
                 model_names: tuple[str, ...] = (), sampling_defaults: SamplingParams | None = None,
                 fill_context_cap: int | None = None) -> None:
        """`model_names`: the names a request may give as `model`, the first the one answers carry (default: the
        engine's --model); `sampling_defaults`: what a field a request leaves unset means (--generation-config);
        `fill_context_cap`: its max_new_tokens, the most a request that fills the context generates (None: no cap)."""
        self.engine = engine
        self.model_names = model_names or (engine.config.model_id,)
        self.sampling_defaults = sampling_defaults or SamplingParams()
        self.fill_context_cap = fill_context_cap
        self.tokenizer = tokenizer
        self.limits = limits or Limits.for_model(engine.config.max_model_len)
        self.pool = pool or TokenizerPool(tokenizer)
        self._grammars: GrammarCompiler | None = None  # made at the first structured output request

    @property
    def grammars(self) -> GrammarCompiler:
        if self._grammars is None:
            cfg = self.engine.config
            self._grammars = GrammarCompiler(self.tokenizer.to_json, cfg.vocab_size,
                                             cfg.eos_token_ids or self.tokenizer.eos_token_ids)
        return self._grammars

    @property
    def model_id(self) -> str:
        """The model's name in answers (the first of --served-model-name, else --model)."""
        return self.model_names[0]

    @property
    def tracing(self) -> Tracing | None:
        """The engine's (--otlp-endpoint): a request's spans begin here and go on in its steps; None: no traces, and
        no work for them."""
        return self.engine.tracing

    @property
    def root_model_id(self) -> str:
        """The model itself (--model), whatever names it is served under."""
        return self.engine.config.model_id

    @property
    def metrics_registry(self):
        """The engine's metrics (prometheus_client's CollectorRegistry), for /metrics on the API port."""
        return self.engine.metrics.registry

    @property
    def max_model_len(self) -> int:
        return self.engine.config.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.config.vocab_size

    @property
    def max_n(self) -> int:
        return self.engine.config.max_num_seqs

    def serving(self) -> tuple[bool, str]:
        """(True, "") when requests can be served now, else (False, why): no worker, or draining."""
        return self.engine.serving()

    async def prompt_token_ids(self, inp: GenerateInput) -> tuple[str, list[int]]:
        """(the input's field name, its token ids). Raises EngineError(INVALID_ARGUMENT) naming the field, or
        RESOURCE_EXHAUSTED when too many prompts are being tokenized. NOTE: the bounds are checked first, in time
        linear in the input; a long text then goes to the tokenizer pool, so the event loop never waits on it."""
        given = [name for name in INPUTS if getattr(inp, name) is not None]
        if len(given) != 1:
            raise invalid(given[1] if given else "prompt", "set exactly one of prompt, prompt_token_ids and "
                          f"messages (got {' and '.join(given) if given else 'none'})")
        self.limits.check(inp)
        self.check_seqs(1, inp.sampling.n)
        kind, limit = given[0], self.max_model_len - 1
        keep = self._kept_tokens(inp, limit)
        # NOTE: a prompt to truncate may be longer than the context: the tokenizer's bound is then one that only
        # the prompt's characters bound (a character is at most 4 tokens of a byte-level vocabulary)
        bound = limit if keep is None else 4 * self.limits.max_prompt_chars
        if kind == "prompt_token_ids":
            if len(inp.prompt_token_ids) > limit and keep is None:  # NOTE: before copying up to a million ids
                raise invalid(kind, f"{kind} has {len(inp.prompt_token_ids)} tokens; max_model_len "
                                    f"{self.max_model_len} leaves room for at most {limit}")
            ids = list(inp.prompt_token_ids)
        elif kind == "prompt":
            ids = await self.pool.encode(inp.prompt, bound, inp.add_special_tokens)
        else:
            ids = await self._chat_ids(inp, bound)
        if isinstance(ids, int):  # too many to bring back from the tokenizer: their number
            raise invalid(kind, f"{kind} has {ids} tokens after tokenizing; max_model_len {self.max_model_len} "
                                f"leaves room for at most {limit}")
        if keep is not None and len(ids) > keep:
            ids = ids[-keep:] if inp.truncation_side == "left" else ids[:keep]
        if not ids:
            raise invalid(kind, f"{kind} is empty")
        return kind, ids

    @staticmethod
    def _kept_tokens(inp: GenerateInput, limit: int) -> int | None:
        """How many prompt tokens truncate_prompt_tokens keeps (None: no truncation); `limit`: the most a prompt may
        have. Raises EngineError naming the field when it is out of range."""
        k = inp.truncate_prompt_tokens
        if k is None:
            return None
        if inp.truncation_side not in ("left", "right"):
            raise invalid("truncation_side", f"truncation_side must be left or right, got {inp.truncation_side!r}")
        if k == -1:
            return limit
        if not 1 <= k <= limit:
            raise invalid("truncate_prompt_tokens", f"truncate_prompt_tokens must be -1 (as many as max_model_len "
                                                    f"leaves room for) or in [1, {limit}], got {k}")
        return k

    def check_seqs(self, num_prompts: int, n: int) -> None:
        """Before any prompt is tokenized: n within --max-num-seqs (the samples run side by side), the request's
        sequences (`num_prompts` x n) within --max-seqs-per-request, and its prompts (one engine request each)
        within what the queue can ever hold. Raises EngineError(INVALID_ARGUMENT) naming n or prompt."""
        cfg = self.engine.config
        if n > cfg.max_num_seqs:
            raise invalid("n", f"n must be in [1, {cfg.max_num_seqs}] (max_num_seqs: the samples run side by side), "
                               f"got {n}{_wrapped(n)}")
        self.limits.check_seqs(num_prompts, n)
        if num_prompts > cfg.max_queued_requests:  # NOTE: only if --max-seqs-per-request is set above the queue
            raise invalid("prompt", f"prompt has {num_prompts} prompts, one request each; the request queue holds "
                                    f"at most {cfg.max_queued_requests} (--max-queued-requests)")

    def check_batch(self, num_prompts: int, n: int) -> None:
        """check_seqs for a /v1/completions batch, then whether the queue has room for all its prompts now
        (RESOURCE_EXHAUSTED), so that a batch is not half admitted, then refused by its own prompts."""
        self.check_seqs(num_prompts, n)
        if num_prompts > 1:
            self.engine.check_queue(num_prompts)

    async def _chat_ids(self, inp: GenerateInput, limit: int) -> list[int] | int:
        if not inp.messages:
            raise invalid("messages", "messages is empty")
        for i, m in enumerate(inp.messages):
            if not isinstance(m.get("role"), str) or not m["role"]:
                raise invalid("messages", f"messages[{i}].role must be a non-empty string")
        try:
            return await self.pool.encode_chat(list(inp.messages), inp.chat_template_kwargs, limit, inp.chat_options)
        except EngineError:
            raise
        except FinalMessageError as e:
            raise invalid("continue_final_message", str(e)) from None
        except TemplateRefusal as e:  # NOTE: the template's own words (e.g. roles that do not alternate)
            raise invalid("messages", f"messages: the chat template refused them: {e}") from None
        except Exception as e:
            # NOTE: a template's code failing on a conversation it was not written for (a field it reads missing,
            # None where it adds strings...): its raw message (`'dict object' has no attribute 'content'`) means
            # nothing to a client, so it is named by kind only.
            raise invalid("messages", f"messages: the model's chat template cannot render this conversation "
                                      f"({_template_failure(e)}); check each message's role, content and "
                                      f"tool_calls") from None

    def generate(self, inp: GenerateInput, trace_headers: Mapping[str, str] | None = None) -> \
            Coroutine[None, None, RequestStream]:
        """Tokenizes, validates and admits `inp` (await it); iterate the returned stream for its StreamItems.
        Raises EngineError (INVALID_ARGUMENT names the field). With tracing, `trace_headers` (HTTP headers or gRPC
        metadata) may hold the caller's W3C traceparent: the request's span is then its child. NOTE: a plain function,
        so that without tracing a request costs no coroutine more than before the hooks."""
        if self.tracing is None:
            return self._generate(inp, None)
        return self._traced(inp, trace_headers)

    async def _traced(self, inp: GenerateInput, trace_headers: Mapping[str, str] | None) -> RequestStream:
        trace = self.tracing.start(inp, trace_headers)
        try:
            return await self._generate(inp, trace)
        except (EngineError, asyncio.CancelledError) as e:
            trace.refused(e)
            raise

    async def _generate(self, inp: GenerateInput, trace: RequestTrace | None) -> RequestStream:
        if self.engine.draining:  # before tokenizing: the engine would refuse it anyway
            raise EngineError(ErrorCode.UNAVAILABLE, DRAINING)
        self._check_scheduling(inp)
        kind, ids = await self.prompt_token_ids(inp)
        sampling = inp.sampling
        if sampling.top_k < -1:
            raise invalid("top_k", f"top_k must be >= 1, or 0 or -1 to keep all tokens; got {sampling.top_k}")
        if sampling.top_k == -1:  # vLLM's spelling of "off"
            sampling = dataclasses.replace(sampling, top_k=0)
        if inp.fill_context:
            max_tokens = max(1, self.engine.max_output_tokens(len(ids), max(1, sampling.n)))
            max_tokens = min(max_tokens, self.fill_context_cap or max_tokens)
            sampling = dataclasses.replace(sampling, max_tokens=max_tokens)
        # vLLM's echo with max_tokens 0: the prompt alone is scored (prompt_logprobs); one token is computed, as its
        # last prompt row is anyway, and dropped (RequestStream's discard_output)
        discard_output = inp.echo and sampling.max_tokens == 0
        if discard_output:
            sampling = dataclasses.replace(sampling, max_tokens=1)
        if inp.bad_words:
            sampling = dataclasses.replace(sampling, bad_words_token_ids=self.bad_words_token_ids(
                inp.bad_words, sampling.bad_words_token_ids))
        stop = tuple(s for s in inp.stop if s)
        metrics, tokenizer = self.engine.metrics, self.tokenizer
        try:
            try:
                self._check(ids, sampling)
                grammar = await self._grammar(sampling)
            except InvalidField as e:
                raise invalid(e.field, str(e)) from None
            echo_text = await self._echo_text(inp, ids) if inp.echo else None  # NOTE: after the vocabulary check
            text = {"include_stop_str": inp.include_stop_str_in_output, "skip_special_tokens": inp.skip_special_tokens,
                    "echo_text": echo_text, "discard_output": discard_output}
            def open_stream(req):
                stream = RequestStream(req, tokenizer, stop, metrics, **text)
                if trace is not None:  # NOTE: before the engine can end it (request_log ends its trace)
                    stream.trace = trace
                return stream

            return self.engine.submit(inp.request_id, ids, sampling, inp.cache_salt, grammar=grammar,
                                      open_stream=open_stream, priority=inp.priority, tenant=inp.tenant)
        except EngineError as e:
            if e.field == "prompt_token_ids" and kind != "prompt_token_ids":
                e.field = kind  # the ids came from this field
            raise

    def _check_scheduling(self, inp: GenerateInput) -> None:
        """priority needs the priority policy (vLLM refuses it likewise) and no more urgency than the caller's key
        grants (max-priority: PERMISSION_DENIED, not clamped, so the client knows); a tenant name is short visible
        ASCII."""
        policy = self.engine.config.scheduling_policy
        if inp.priority and policy != "priority":
            raise invalid("priority", f"priority {inp.priority} needs --scheduling-policy priority (this server "
                                      f"admits by {policy}); send 0 or leave it unset")
        if not -2**31 <= inp.priority < 2**31:
            raise invalid("priority", f"priority must fit in 32 bits (-2147483648..2147483647), got {inp.priority}")
        if inp.priority < inp.max_priority:
            raise EngineError(ErrorCode.PERMISSION_DENIED, f"priority {inp.priority} is more urgent than this API key "
                                                           f"may ask (max-priority={inp.max_priority}, lower is more "
                                                           f"urgent): send {inp.max_priority} or more", "priority")
        t = inp.tenant
        if len(t) > MAX_TENANT_CHARS or not all(" " <= c <= "~" for c in t):
            raise invalid(TENANT_HEADER, f"{TENANT_HEADER} must be at most {MAX_TENANT_CHARS} visible ASCII characters "
                                         f"(spaces included), got {len(t)} characters")

    async def _echo_text(self, inp: GenerateInput, ids: list[int]) -> str:
        """The prompt's text for echo: a text prompt as given; token ids (or a rendered chat) decoded."""
        if inp.prompt is not None:
            return inp.prompt
        return await self.pool.decode(ids, inp.skip_special_tokens)

    async def _grammar(self, sp: SamplingParams) -> Grammar | None:
        """structured_output compiled (off the event loop, cached by spec); raises InvalidField naming it."""
        if sp.structured_output is None:
            return None
        return await self.grammars.compile(sp.structured_output)

    def bad_words_token_ids(self, bad_words: tuple[str, ...],
                            given: tuple[tuple[int, ...], ...] = ()) -> tuple[tuple[int, ...], ...]:
        """`given` and each bad word's tokenizations: as the first word of the output and after a space (the space
        merges into the word's first token in most vocabularies), each sequence once. NOTE: inline: the words are
        few and short (Limits: --max-stop-strings words of up to 1,024 characters)."""
        out = dict.fromkeys(given)
        for word in bad_words:
            word = word.lstrip()
            for text in (word, " " + word):
                ids = tuple(self.tokenizer.encode(text, add_special_tokens=False)) if word else ()
                if ids:
                    out.setdefault(ids)
        return tuple(out)

    def _check(self, ids: list[int], sp: SamplingParams) -> None:
        """Raises InvalidField when a request can never be served by this model, whichever worker takes it (the
        engine then checks what needs the fleet: Scheduler.check_fits, per worker, capacity only). n was checked
        before tokenizing (check_seqs)."""
        cfg = self.engine.config
        for field, values in (("prompt_token_ids", ids), ("stop_token_ids", sp.stop_token_ids),
                              ("logit_bias", (t for t, _ in sp.logit_bias)),
                              ("bad_words_token_ids", (t for seq in sp.bad_words_token_ids for t in seq)),
                              ("allowed_token_ids", sp.allowed_token_ids)):
            bad = next((t for t in values if not 0 <= t < cfg.vocab_size), None)
            if bad is not None:
                raise InvalidField(field, f"{field}: {bad} is outside the vocabulary (size {cfg.vocab_size})")
        sp.validate()
        _check_allow_list(sp, cfg.eos_token_ids)
        # NOTE: these bounds also catch a negative number a client sent into an unsigned field (it wraps to 2^32 - x)
        if sp.max_tokens > cfg.max_model_len:
            raise InvalidField("max_tokens", f"max_tokens must be in [1, {cfg.max_model_len}] (max_model_len), got "
                                             f"{sp.max_tokens}{_wrapped(sp.max_tokens)}")

    def kv_state(self, worker_id: str = "", tenant: str | None = None) -> KVPoolSnapshot:
        """One worker's KV pool between two steps (GetKVState; Engine.kv_state)."""
        return self.engine.kv_state(worker_id, tenant)

    def model_workers(self) -> dict[str, WorkerRegistration]:
        """The attached workers' registrations by worker id (GetModelInfo, /v1/models)."""
        return self.engine.model_workers()

    def abort(self, request_id: str) -> None:
        """The client went away (cancel, deadline, disconnect): its blocks go back to the pool at the next step."""
        self.engine.abort(request_id)

    def token_text(self, token_id: int) -> str:
        """One token's own text (special tokens included), for logprobs."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)
