"""vLLM's `prompt_logprobs` field on whatever route asked for it (Serving adds it; its JSON is convert's): one entry
per prompt token, None for the first (no token precedes it). Completions put it on each choice (the same list on each
of a prompt's n choices), chat completions on the response, as vLLM does. Streamed (vLLM refuses that; here it
works) it rides on the first chunk that follows the prompt's last row: a completion choice's first chunk, the chat
stream's first chunk after its role chunks. OpenAI's legacy shape of an echoed prompt is the completions route's own
(convert.echo_logprobs)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from scheduler_svc.frontend import FrontEnd, RequestStream
from scheduler_svc.http.convert import vllm_prompt_logprobs


class PromptLogprobsField:
    """The field for one HTTP request (Job.prompt_logprobs set): each prompt's list made once, when its log is
    complete, whatever the number of its choices."""

    def __init__(self, frontend: FrontEnd, streams: list[RequestStream], n: int, num_top: int) -> None:
        self.frontend, self.streams, self.n, self.num_top = frontend, streams, n, num_top
        self._lists: dict[int, list] = {}
        self._given: set[int] = set()  # streamed: the choice indices (chat: 0) that have theirs

    def _list(self, prompt_index: int) -> list | None:
        """The prompt's list; None while its log lacks positions (a stream still before the prompt's last row)."""
        if prompt_index not in self._lists:
            log = self.streams[prompt_index].request.prompt_log
            if log is None or not log.complete:
                return None
            self._lists[prompt_index] = vllm_prompt_logprobs(self.frontend, log.for_client(), self.num_top)
        return self._lists[prompt_index]

    def add_to_answer(self, answer: dict) -> dict:
        if str(answer.get("object", "")).startswith("chat."):
            answer["prompt_logprobs"] = self._list(0)
        else:
            for choice in answer.get("choices", ()):
                choice["prompt_logprobs"] = self._list(choice["index"] // self.n)
        return answer

    async def add_to_chunks(self, chunks: AsyncIterator) -> AsyncIterator:
        async for chunk in chunks:
            if isinstance(chunk, dict) and chunk.get("choices"):
                self._add_to_chunk(chunk)
            yield chunk

    def _add_to_chunk(self, chunk: dict) -> None:
        if str(chunk.get("object", "")).startswith("chat."):
            if 0 not in self._given and (entries := self._list(0)) is not None:
                chunk["prompt_logprobs"] = entries
                self._given.add(0)
            return
        for choice in chunk["choices"]:
            index = choice["index"]
            if index not in self._given and (entries := self._list(index // self.n)) is not None:
                choice["prompt_logprobs"] = entries
                self._given.add(index)
