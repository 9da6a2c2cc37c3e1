"""lm-evaluation-harness's `local-completions` model (its OpenAI completions client: echo + logprobs + max_tokens 1,
the prompt's logprobs read back from choices[].logprobs) scores loglikelihood requests against a real scheduler and
worker exactly as transformers' float32 forward does: each (sum of the continuation's logprobs, is_greedy) within
1e-4. The requests are built here from a text file shipped with the tests (no dataset download); the same run with
max_tokens 0 (vLLM's prompt-only scoring) gives the same."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.service import idle, wait_until
from tests.support.worker import reference_model

lm_eval = pytest.importorskip("lm_eval")
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.openai_completions import LocalCompletionsAPI  # noqa: E402

TOL = 1e-4
TEXT = (Path(__file__).parent / "data" / "heldout.txt").read_text()


class PromptOnlyCompletions(LocalCompletionsAPI):
    """local-completions asking for max_tokens 0: only the prompt is scored, nothing generated (vLLM allows it with
    echo), so the last entry of token_logprobs is the continuation's last token, not a generated one."""

    def _create_payload(self, messages, generate=False, gen_kwargs=None, seed=1234, eos=None, **kwargs) -> dict:
        return {**super()._create_payload(messages, generate, gen_kwargs, seed, eos, **kwargs), "max_tokens": 0}

    @staticmethod
    def parse_logprobs(outputs, tokens=None, ctxlens=None, **kwargs):
        for out in outputs if isinstance(outputs, list) else [outputs]:
            for choice in out["choices"]:  # NOTE: as max_tokens 1 reads them: one (dummy) entry more at the end
                for key in ("token_logprobs", "top_logprobs"):
                    choice["logprobs"][key] = choice["logprobs"][key] + [None]
        return LocalCompletionsAPI.parse_logprobs(outputs, tokens, ctxlens, **kwargs)


def pairs(lm, model) -> list[tuple[str, str]]:
    """(context, continuation) pairs: each line's first words and the rest of it, and each line's first words with
    the tiny model's own greedy next words (kept only where their text tokenizes back to the same ids, so that at
    least one continuation is greedy)."""
    out = []
    for line in TEXT.strip().splitlines():
        words = line.split()
        out.append((" ".join(words[:6]), " " + " ".join(words[6:12])))
        context = " ".join(words[:5])
        ids = lm.tok_encode(context)
        with torch.inference_mode():
            greedy = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=3, pad_token_id=0)[0]
        continuation = lm.tokenizer.decode(greedy[len(ids):])
        if lm._encode_pair(context, continuation)[1] == greedy[len(ids):].tolist():
            out.append((context, continuation))
    return out


def reference(model, lm, context: str, continuation: str) -> tuple[float, bool]:
    """transformers' float32 log_softmax over the very tokens lm-eval sends."""
    ctx, cont = lm._encode_pair(context, continuation)
    ids = ctx + cont
    with torch.inference_mode():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    rows = lp[len(ctx) - 1:len(ids) - 1]
    return rows.gather(1, torch.tensor(cont)[:, None]).sum().item(), bool((rows.argmax(-1) == torch.tensor(cont)).all())


@pytest.mark.parametrize("client", [LocalCompletionsAPI, PromptOnlyCompletions], ids=["max_tokens=1", "max_tokens=0"])
def test_lm_eval_loglikelihood_matches_transformers_float32(service, client):
    lm = client(base_url=f"http://{service.http}/v1/completions", model=service.model_dir,
                tokenizer_backend="huggingface", tokenizer=service.model_dir, tokenized_requests=True,
                max_length=512, batch_size=4, num_concurrent=1, max_retries=1, timeout=300)
    model = reference_model(service.model_dir)
    requests = [Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=i)
                for i, pair in enumerate(pairs(lm, model))]
    got = lm.loglikelihood(requests, disable_tqdm=True)
    want = [reference(model, lm, *r.arguments) for r in requests]
    assert len(got) == len(want) >= 6 and any(greedy for _, greedy in want)
    errors = [abs(g[0] - w[0]) for g, w in zip(got, want)]
    print(f"\nlm-eval {client.__name__}: {len(got)} requests, max |sum logprob - transformers| = {max(errors):.2e}")
    assert max(errors) <= TOL, list(zip(got, want))
    assert [g[1] for g in got] == [w[1] for w in want]
    wait_until(lambda: idle(service))
