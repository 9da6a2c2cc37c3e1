"""What the model's files and the scheduler's vLLM-named flags say about requests: --generation-config's sampling
defaults (HTTP and gRPC), --chat-template, --served-model-name, --seed."""

from __future__ import annotations

import asyncio
import json

import pytest

from pagedserve.v1 import generate_pb2 as pb
from pagedserve_common.sampling import SamplingParams
from pagedserve_common.startup import StartupError
from pagedserve_common.wire import sampling_from_pb, with_defaults
from scheduler_svc.engine import Engine, EngineConfig
from scheduler_svc.frontend.model_defaults import chat_template, fill_context_cap, model_names, sampling_defaults


def write_config(folder, **config) -> str:
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, **config}))
    return str(folder)


def test_auto_takes_the_models_sampling_defaults_as_vllm_does(tmp_path):
    model = write_config(tmp_path, temperature=0.6, top_p=0.9, top_k=20, repetition_penalty=1.1,
                         max_new_tokens=64, do_sample=True, num_beams=1)
    d = sampling_defaults("auto", model)
    assert (d.temperature, d.top_p, d.top_k, d.repetition_penalty, d.max_tokens) == (0.6, 0.9, 20, 1.1, 64)
    assert d.min_p == SamplingParams().min_p  # not in the file: the API's default
    assert sampling_defaults("vllm", model) == SamplingParams()
    # max_new_tokens also caps a request that would generate to the context's end (chat without max_tokens)
    assert (fill_context_cap("auto", model), fill_context_cap("vllm", model)) == (64, None)


def test_a_directory_of_its_own_or_none_at_all(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    assert sampling_defaults(write_config(other, temperature=0.0), str(tmp_path)).temperature == 0.0
    assert sampling_defaults("auto", str(tmp_path)) == SamplingParams()  # NOTE: no generation_config.json
    with pytest.raises(StartupError, match="--generation-config .*: no generation_config.json"):
        sampling_defaults(str(tmp_path / "missing"), str(tmp_path))


def test_a_default_out_of_range_fails_the_start_naming_the_file(tmp_path):
    with pytest.raises(StartupError, match="generation_config.json: top_p must be in"):
        sampling_defaults("auto", write_config(tmp_path, top_p=1.5))


def test_grpc_fields_left_unset_take_the_defaults_and_set_ones_win():
    defaults = SamplingParams(temperature=0.6, top_k=20, max_tokens=64)
    request = pb.SamplingParams(temperature=1.0)
    got = with_defaults(request, sampling_from_pb(request), defaults)
    assert (got.temperature, got.top_k, got.max_tokens) == (1.0, 20, 64)
    assert with_defaults(request, sampling_from_pb(request), SamplingParams()) == sampling_from_pb(request)


def test_chat_template_is_a_file_or_the_template_itself(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert chat_template(str(path)) == path.read_text()
    assert chat_template("{{ messages[0].content }}") == "{{ messages[0].content }}"
    assert chat_template(None) is None
    with pytest.raises(StartupError, match="--chat-template .*missing.jinja: cannot read it"):
        chat_template(str(tmp_path / "missing.jinja"))


def test_served_model_names_replace_the_model_and_keep_their_order():
    assert model_names(("a", "b", "a"), "/models/x") == ("a", "b")
    assert model_names(None, "/models/x") == ("/models/x",)


def seeds(seed: int | None, num: int = 3) -> list[int | None]:
    async def run():
        engine = Engine(EngineConfig(model_id="m", max_model_len=128, vocab_size=100, seed=seed))
        return [engine.submit(f"r{i}", [1, 2, 3], SamplingParams(), open_stream=lambda r: r).sampling.seed
                for i in range(num)]
    return asyncio.run(run())


def test_seed_draws_the_same_seeds_in_arrival_order_and_a_requests_own_wins():
    assert seeds(7) == seeds(7) and len(set(seeds(7))) == 3
    assert seeds(7) != seeds(8)
    assert seeds(None) == [None] * 3  # NOTE: each worker's scheduler draws a random one

    async def own():
        engine = Engine(EngineConfig(model_id="m", max_model_len=128, vocab_size=100, seed=7))
        return engine.submit("r", [1], SamplingParams(seed=5), open_stream=lambda r: r).sampling.seed
    assert asyncio.run(own()) == 5
