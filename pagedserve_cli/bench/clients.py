"""Streaming benchmark clients, ours over gRPC and any OpenAI-compatible server, recording the same timings."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from pagedserve_cli.bench.workloads import BenchRequest
from pagedserve_common.defaults import TENANT_HEADER

now = time.perf_counter


@dataclass(slots=True)
class RequestRecord:
    """What one streamed request did. Times are seconds on one clock (the runner makes them run-relative)."""

    index: int
    prompt_tokens: int
    max_tokens: int
    send_time: float = 0.0
    first_token_time: float | None = None
    end_time: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # arrival of every chunk with tokens, first included
    chunk_tokens: list[int] = field(default_factory=list)  # how many tokens each of those chunks carried
    output_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None

    def add_chunk(self, t: float, tokens: int) -> None:
        if self.first_token_time is None:
            self.first_token_time = t
        self.chunk_times.append(t)
        self.chunk_tokens.append(tokens)

    def finish(self) -> RequestRecord:
        self.end_time = now()
        if not self.output_tokens:  # the server sent no usage: count what arrived
            self.output_tokens = sum(self.chunk_tokens)
        if self.error is None and self.finish_reason is None:
            self.error = "the stream ended without a finish reason"
        return self


class GrpcClient:
    """pagedserve.v1.Generation/Generate over grpc.aio; one channel for every request."""

    def __init__(self, server: str, temperature: float = 0.0, ignore_eos: bool = False, tenant: str = "",
                 priority: int = 0) -> None:
        self.server, self.temperature, self.ignore_eos = server, temperature, ignore_eos
        self.priority = priority  # GenerateRequest.priority (--scheduling-policy priority)
        self.metadata = ((TENANT_HEADER, tenant),) if tenant else ()  # whose service (--scheduling-policy fair)
        self._channel = self._stub = None

    async def start(self, timeout: float = 30.0) -> dict:
        """Connects; returns {'max_model_len': N, 'model': ID, 'workers': [{worker_id, num_blocks, block_size, dtype}]}.
        Raises ConnectionError when the server can't be reached."""
        import grpc

        from pagedserve.v1 import generate_pb2, generate_pb2_grpc

        # NOTE: a long-running bench opens many streams at once; no per-connection cap on our side.
        self._channel = grpc.aio.insecure_channel(self.server)
        self._stub = generate_pb2_grpc.GenerationStub(self._channel)
        try:
            info = await self._stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=timeout,
                                                 wait_for_ready=True)
        except grpc.aio.AioRpcError as e:
            await self.close()
            raise ConnectionError(f"{self.server}: {e.code().name}: {e.details()}") from None
        return {"max_model_len": info.max_model_len or None, "model": info.model_id,
                "workers": [{"worker_id": w.worker_id, "num_blocks": w.num_blocks, "block_size": w.block_size,
                             "dtype": w.dtype} for w in info.workers]}

    async def generate(self, index: int, req: BenchRequest) -> RequestRecord:
        import grpc

        from pagedserve.v1 import generate_pb2 as pb

        rec = RequestRecord(index, req.prompt_len or 0, req.max_tokens)
        msg = pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=req.max_tokens, temperature=self.temperature,
                                                            ignore_eos=self.ignore_eos), priority=self.priority)
        if req.prompt_token_ids is not None:
            msg.prompt_token_ids.extend(req.prompt_token_ids)
        else:
            msg.prompt = req.prompt
        rec.send_time = now()
        try:
            async for resp in self._stub.Generate(msg, metadata=self.metadata):
                if resp.token_ids:
                    rec.add_chunk(now(), len(resp.token_ids))
                if resp.finish_reason:
                    rec.finish_reason = pb.FinishReason.Name(resp.finish_reason).removeprefix("FINISH_REASON_").lower()
                    rec.prompt_tokens = resp.usage.prompt_tokens or rec.prompt_tokens
                    rec.output_tokens = resp.usage.completion_tokens
        except grpc.aio.AioRpcError as e:
            rec.error = f"{e.code().name}: {e.details()}"
        if rec.finish_reason == "abort":
            rec.error = "aborted by the server"
        return rec.finish()

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None


class OpenAIClient:
    """POST {url}/completions with stream: true (vLLM, llama.cpp's server, ...), the same requests as ours."""

    def __init__(self, url: str, model: str | None = None, temperature: float = 0.0,
                 ignore_eos: bool = False, tenant: str = "", priority: int = 0) -> None:
        self.url, self.model = url.rstrip("/"), model
        self.temperature, self.ignore_eos, self.priority = temperature, ignore_eos, priority
        self.headers = {TENANT_HEADER: tenant} if tenant else {}
        self._http = None

    async def start(self, timeout: float = 30.0) -> dict:
        """Checks GET {url}/models; picks the first model when none was named. ConnectionError if unreachable."""
        import httpx

        # NOTE: no timeout on streams (a loaded peer may take minutes) and no cap on parallel connections.
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=timeout),
                                       limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))
        try:
            resp = await self._http.get(f"{self.url}/models", timeout=timeout)
        except httpx.HTTPError as e:
            await self.close()
            raise ConnectionError(f"{self.url}: {type(e).__name__}: {e}") from None
        cards = []
        if resp.status_code == 200:
            try:
                cards = resp.json().get("data") or []
            except (ValueError, AttributeError):
                cards = []
        card = next((c for c in cards if c.get("id") == self.model), cards[0] if cards else {})
        if self.model is None:
            self.model = card.get("id")
        return {"max_model_len": card.get("max_model_len"), "model": self.model}

    def body(self, req: BenchRequest) -> dict:
        body = {"model": self.model,
                "prompt": list(req.prompt_token_ids) if req.prompt_token_ids is not None else req.prompt,
                "max_tokens": req.max_tokens, "temperature": self.temperature, "stream": True,
                "stream_options": {"include_usage": True}}
        if self.ignore_eos:  # a vLLM extension: only sent when asked for, so strict servers still accept the rest
            body["ignore_eos"] = True
        if self.priority:  # vLLM's and ours (--scheduling-policy priority): only sent when set, likewise
            body["priority"] = self.priority
        return body

    async def generate(self, index: int, req: BenchRequest) -> RequestRecord:
        import httpx

        rec = RequestRecord(index, req.prompt_len or 0, req.max_tokens)
        body = self.body(req)
        rec.send_time = now()
        try:
            async with self._http.stream("POST", f"{self.url}/completions", json=body, headers=self.headers) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread()).decode(errors="replace")
                    rec.error = f"HTTP {resp.status_code}: {text[:300]}"
                    return rec.finish()
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    self._on_chunk(rec, json.loads(data))
        except (httpx.HTTPError, ValueError) as e:
            rec.error = f"{type(e).__name__}: {e}"
        return rec.finish()

    @staticmethod
    def _on_chunk(rec: RequestRecord, chunk: dict) -> None:
        t = now()
        if chunk.get("error"):
            rec.error = str(chunk["error"])[:300]
            return
        for choice in chunk.get("choices") or []:
            # Each chunk with text is one token event; the usage chunk gives the exact total.
            if choice.get("text"):
                rec.add_chunk(t, 1)
            if choice.get("finish_reason"):
                rec.finish_reason = choice["finish_reason"]
        usage = chunk.get("usage")
        if usage:
            rec.prompt_tokens = usage.get("prompt_tokens") or rec.prompt_tokens
            rec.output_tokens = usage.get("completion_tokens") or rec.output_tokens

    async def close(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None
