"""One client request's stream: detokenizes each sample's tokens, applies stop strings, times the tokens."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from pagedserve_common.step import PositionLogprobs
from scheduler_svc.core.request import FinishReason, Request, RequestOutput
from scheduler_svc.errors import EngineError, ErrorCode
from scheduler_svc.metrics import Metrics
from scheduler_svc.frontend.detokenizer import IncrementalDetokenizer


@dataclass(slots=True)
class StreamItem:
    """New output of one sample; the last one of a sample has finish_reason and usage."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None = None
    logprobs: list[PositionLogprobs] = field(default_factory=list)  # one per token, when asked for
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    # The prompt's logprobs (sampling.prompt_logprobs set): one per prompt token, None first (no token precedes
    # it), on the first item of each sample only (its echo item when echo is set)
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    echo: bool = False  # the item is the prompt (echo): token_ids are the prompt's, text its text


@dataclass(slots=True)
class _Sample:
    detok: IncrementalDetokenizer
    num_tokens: int = 0
    first_token_time: float = 0.0
    last_token_time: float = 0.0
    finished: bool = False
    finish_reason: FinishReason | None = None


class RequestStream:
    """Fed by the engine's step loop, read by the Generate handler (`async for item in stream`)."""

    trace = None  # NOTE: a class attribute: set per stream only with --otlp-endpoint (scheduler_svc.tracing)

    def __init__(self, request: Request, tokenizer, stop: tuple[str, ...], metrics: Metrics, *,
                 include_stop_str: bool = False, skip_special_tokens: bool = True,
                 echo_text: str | None = None, discard_output: bool = False) -> None:
        """`echo_text`: the prompt's text, sent first (one item per sample: the prompt's ids and this text, and its
        prompt logprobs when asked for: then it waits for the sample's first token, which comes once they are all
        in); None sends only the output. `discard_output`: the output is computed but not sent (echo with max_tokens
        0: the prompt alone is scored): each sample's one item has no tokens, no text, and finish reason LENGTH."""
        self.request = request
        self.metrics = metrics
        self.queue: asyncio.Queue[StreamItem | tuple[str, str] | None] = asyncio.Queue()
        self.samples = [_Sample(IncrementalDetokenizer(tokenizer, request.prompt_token_ids, skip_special_tokens,
                                                       stop=list(stop), include_stop_str=include_stop_str,
                                                       min_tokens=request.sampling.min_tokens))
                        for _ in range(request.sampling.n)]
        self.discard_output = discard_output
        # NOTE: with prompt logprobs the echo waits for them (push); without, it goes first, now
        self._echo_text = echo_text if request.prompt_log is not None else None
        if echo_text is not None and self._echo_text is None:
            for index in range(request.sampling.n):
                self.queue.put_nowait(StreamItem(index, list(request.prompt_token_ids), echo_text, echo=True))
        self.num_open = request.sampling.n
        self.arrival = time.monotonic()
        self.first_token_time: float | None = None  # monotonic, of any sample
        self.end_logged = False  # NOTE: scheduler_svc.request_log writes one line per request, at its end

    @property
    def done(self) -> bool:
        return self.num_open == 0

    def push(self, out: RequestOutput, logprobs: PositionLogprobs | None, now: float) -> FinishReason | None:
        """Streams one step's tokens of one sample; returns STOP_STRING when its text hit a stop string."""
        s = self.samples[out.index]
        if s.finished:
            return None
        first = s.num_tokens == 0
        self._time_tokens(s, len(out.new_token_ids), now)
        item = self._item(s, out, logprobs)
        if first and self.request.prompt_log is not None:
            # NOTE: complete now: a sample's first token comes after its prompt's last row (Scheduler.update)
            item.prompt_logprobs = self.request.prompt_log.for_client()
            if self._echo_text is not None:
                self.queue.put_nowait(StreamItem(out.index, list(self.request.prompt_token_ids), self._echo_text,
                                                 prompt_logprobs=item.prompt_logprobs, echo=True))
                item.prompt_logprobs = None
        reason = item.finish_reason
        if reason is not None:
            s.finished, s.finish_reason = True, reason
            self.num_open -= 1
            item.prompt_tokens = len(self.request.prompt_token_ids)
            item.completion_tokens = 0 if self.discard_output else s.num_tokens
            item.cached_prompt_tokens = self.request.num_cached_prompt_tokens
            if self.num_open == 0:
                self.metrics.e2e.observe(now - self.arrival)
        self.queue.put_nowait(item)
        if self.num_open == 0:
            self.queue.put_nowait(None)
        return reason

    def _time_tokens(self, s: _Sample, num_new: int, now: float) -> None:
        """Counts `num_new` tokens of sample `s` at `now`: TTFT at its first, inter-token latency after."""
        m, p = self.metrics, self.metrics.protocol
        if s.num_tokens == 0:
            m.ttft.observe(now - self.arrival)
            m.tenant_ttft.labels(m.tenant_label(self.request.tenant)).observe(now - self.arrival)
            s.first_token_time = now
            if self.first_token_time is None:
                self.first_token_time = now
                p.first_token(self, now)
        else:
            m.itl.observe(now - s.last_token_time)
            p.itl.observe(now - s.last_token_time)
        s.num_tokens += num_new
        p.generation_tokens.inc(num_new)
        s.last_token_time = now

    def _item(self, s: _Sample, out: RequestOutput, logprobs: PositionLogprobs | None) -> StreamItem:
        """The item of `out`'s tokens: their text (detokenized, up to a stop string) and finish reason."""
        if self.discard_output:  # NOTE: max_tokens is 1 here: the one token computed ends the sample
            reason = None if out.finish_reason is None else FinishReason.LENGTH
            return StreamItem(out.index, [], "", reason)
        res = s.detok.push(out.new_token_ids)
        text, reason = res.text_delta, out.finish_reason
        if res.stopped:
            reason = FinishReason.STOP_STRING
        elif reason is not None:
            text += s.detok.flush().text_delta
        return StreamItem(out.index, list(out.new_token_ids), text, reason, [logprobs] if logprobs is not None else [])

    def fail(self, code: str, message: str) -> None:
        self.queue.put_nowait((code, message))

    def __aiter__(self):
        return self

    async def __anext__(self) -> StreamItem:
        item = await self.queue.get()
        if item is None:
            raise StopAsyncIteration
        if isinstance(item, tuple):
            raise EngineError(ErrorCode(item[0]), item[1])
        return item
