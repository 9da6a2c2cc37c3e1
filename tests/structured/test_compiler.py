"""Specs to grammars: each kind compiles and constrains, a bad spec is InvalidField naming structured_output, the
outcome is cached by spec, and regex classes read as ASCII."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from pagedserve_common.sampling import InvalidField, StructuredOutput
from scheduler_svc.errors import EngineError, ErrorCode
from scheduler_svc.structured import GrammarCompiler, fill_bitmasks, token_allowed
from scheduler_svc.structured.compiler import ascii_classes
from tests.support.grammar import EOS, VOCAB


def allowed(constraint) -> set[int]:
    mask = fill_bitmasks([constraint], VOCAB)[0]
    assert len(mask) == 4 * ((VOCAB + 31) // 32)
    return {t for t in range(VOCAB) if token_allowed(mask, t)}


def texts(tokenizer, ids) -> set[str]:
    return {tokenizer.decode([t], skip_special_tokens=False) for t in ids}


def walk(tokenizer, constraint, text: str) -> None:
    for tok in tokenizer.encode(text, add_special_tokens=False):
        assert tok in allowed(constraint), (text, tokenizer.decode([tok]))
        assert constraint.accept(tok)


def test_a_choice_allows_only_its_prefixes_and_ends_once_whole(compile_, tokenizer):
    c = compile_(StructuredOutput("choice", choices=("yes", "no"))).constraint()
    assert texts(tokenizer, allowed(c)) <= {"y", "ye", "yes", "n", "no"}
    walk(tokenizer, c, "yes")
    assert c.finished  # nothing may follow: the sample ends without waiting for EOS


def test_a_json_schema_allows_eos_exactly_when_the_output_is_a_whole_match(compile_, tokenizer):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    c = compile_(StructuredOutput("json_schema", json.dumps(schema))).constraint()
    assert EOS not in allowed(c)
    walk(tokenizer, c, '{"n":12')
    assert EOS not in allowed(c) and not c.finished
    walk(tokenizer, c, "}")
    assert EOS in allowed(c)
    assert c.accept(EOS) and c.finished


@pytest.mark.parametrize("so, text", [
    (StructuredOutput("json_object"), '{"a":[1,true,null]}'),
    (StructuredOutput("regex", r"\d{3}-[a-z]+"), "123-abc"),
    (StructuredOutput("grammar", 'start: "x" NUM\nNUM: /[0-9]+/'), "x42"),
    (StructuredOutput("grammar", 'root ::= "x" [0-9]+'), "x42"),  # GBNF
    (StructuredOutput("choice", choices=('say "hi"', "a\\b")), 'say "hi"'),
])
def test_each_kind_accepts_a_match(compile_, tokenizer, so, text):
    c = compile_(so).constraint()
    walk(tokenizer, c, text)
    assert EOS in allowed(c) or c.finished


def test_a_regex_digit_is_an_ascii_digit(compile_, tokenizer):
    c = compile_(StructuredOutput("regex", r"\d")).constraint()
    assert texts(tokenizer, allowed(c)) == set("0123456789")
    assert ascii_classes(r"[\d.]+\w\\d\D") == r"[0-9.]+[0-9A-Za-z_]\\d\D"


@pytest.mark.parametrize("so, words", [
    (StructuredOutput("json_schema", "{not json"), "is not JSON"),
    (StructuredOutput("json_schema", "[1]"), "must be a JSON object"),
    # NOTE: parsed with its nesting bounded (scheduler_svc.json_text): 1,200 levels were a RecursionError
    (StructuredOutput("json_schema", '{"a":' * 1200 + "1" + "}" * 1200), "more than 64 levels deep"),
    (StructuredOutput("json_schema", '{"type": "nonsense"}'), "does not compile"),
    (StructuredOutput("regex", "(("), "does not compile"),
    # NOTE: measured: its every mask costs 26-59 ms here (a JSON schema's 0.2 ms); refused, never served slowly
    (StructuredOutput("regex", "x{65535}"), r"costs \d+ ms per token to follow; at most 10 ms"),
    (StructuredOutput("grammar", "start: undefined"), "does not compile"),
    (StructuredOutput("choice"), "at least one choice"),
    (StructuredOutput("regex"), "is empty"),
    (StructuredOutput("yaml", "x"), "unknown kind"),
])
def test_a_bad_spec_is_invalid_field_naming_structured_output(compile_, so, words):
    with pytest.raises(InvalidField, match=words) as e:
        compile_(so)
    assert e.value.field == "structured_output"


def test_outcomes_are_cached_by_spec_refusals_too(tokenizer):
    compiler = GrammarCompiler(tokenizer.to_json, VOCAB, [EOS])

    def compile_(so):
        return asyncio.run(compiler.compile(so))

    good, bad = StructuredOutput("regex", "a+"), StructuredOutput("regex", "((")
    g1 = compile_(good)
    for _ in range(2):
        with pytest.raises(InvalidField):
            compile_(bad)
    assert compile_(StructuredOutput("regex", "a+")) is g1 and compiler.num_compiled == 2
    # each sample gets a matcher of its own: one moving leaves the others (and its forks) at the start
    a, b = g1.constraint(), g1.constraint()
    start = allowed(b)
    walk(tokenizer, a, "aaa")
    assert allowed(b) == start and allowed(a.fork()) == start and allowed(a) != start
    compiler.close()


def test_the_cache_is_bounded(tokenizer):
    c = GrammarCompiler(tokenizer.to_json(), VOCAB, [EOS], cache_size=3)
    for i in range(5):
        asyncio.run(c.compile(StructuredOutput("regex", f"a{i}")))
    assert len(c._cache) == 3
    c.close()


def test_a_batch_of_masks_equals_the_masks_one_by_one(compile_, tokenizer):
    g = compile_(StructuredOutput("json_schema", json.dumps({"type": "array", "items": {"type": "integer"}})))
    cs = [g.constraint() for _ in range(3)]
    walk(tokenizer, cs[1], "[1")
    walk(tokenizer, cs[2], "[1,2]")
    assert fill_bitmasks(cs, VOCAB) == [fill_bitmasks([c], VOCAB)[0] for c in cs]


def test_a_failed_matcher_allows_only_eos(compile_):
    c = compile_(StructuredOutput("regex", "a")).constraint()
    c.failed = True
    assert allowed(c) == {EOS} and c.finished


def test_the_structured_package_leaves_torch_and_transformers_out():
    code = ("import sys, scheduler_svc.structured, scheduler_svc.http.structured; "
            "print(sorted(m for m in ('torch', 'transformers', 'grpc') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "[]"


def test_the_grammar_engine_loads_at_the_first_compile_not_with_the_scheduler(default_model):
    # NOTE: llguidance (~5 MB resident) and numpy (~11 MB) stay out of a scheduler never asked for structured output
    code = ("import asyncio, sys\n"
            "import pagedserve_cli.main, scheduler_svc.engine, scheduler_svc.http.app, scheduler_svc.server\n"
            "from pagedserve_common.sampling import StructuredOutput\n"
            "from scheduler_svc.frontend.tokenizer import Tokenizer\n"
            "from scheduler_svc.structured import GrammarCompiler\n"
            "loaded = lambda: sorted(m for m in ('llguidance', 'numpy') if m in sys.modules)\n"
            "print(loaded())\n"
            f"compiler = GrammarCompiler(Tokenizer.from_model_dir(sys.argv[1]).to_json(), {VOCAB}, [{EOS}])\n"
            "print(loaded())\n"
            "asyncio.run(compiler.compile(StructuredOutput('regex', 'a+')))\n"
            "print(loaded())\n"
            "compiler.close()\n")
    out = subprocess.run([sys.executable, "-c", code, str(default_model)], check=True, capture_output=True,
                         text=True).stdout
    assert out.split("\n")[:3] == ["[]", "[]", "['llguidance']"]


def test_compiles_beyond_the_pending_bound_are_refused_at_once(tokenizer):
    c = GrammarCompiler(tokenizer.to_json, VOCAB, [EOS], max_pending=2)

    async def burst():
        return await asyncio.gather(*(c.compile(StructuredOutput("regex", f"b{i}")) for i in range(3)),
                                    return_exceptions=True)

    outcomes = asyncio.run(burst())
    refused = [o for o in outcomes if isinstance(o, EngineError)]
    assert len(refused) == 1 and refused[0].code is ErrorCode.RESOURCE_EXHAUSTED
    assert c.num_pending == 0 and asyncio.run(c.compile(StructuredOutput("regex", "b9"))) is not None
    c.close()


def test_the_same_spec_sent_at_once_is_compiled_once(tokenizer):
    """48 requests with one costly regex (issue 50's flood): one compile, one refusal for all of them."""
    c = GrammarCompiler(tokenizer.to_json, VOCAB, [EOS])

    async def burst():
        return await asyncio.gather(*(c.compile(StructuredOutput("regex", "x{65535}")) for _ in range(48)),
                                    return_exceptions=True)

    outcomes = asyncio.run(burst())
    assert all(isinstance(o, InvalidField) and "ms per token" in str(o) for o in outcomes), outcomes[:2]
    assert c.num_compiled == 1 and c.num_pending == 0 and not c._jobs
    c.close()


def test_a_compile_that_outlasts_its_caller_is_kept_for_the_next(tokenizer):
    c = GrammarCompiler(tokenizer.to_json, VOCAB, [EOS], timeout=1e-6)
    so = StructuredOutput("regex", "a+b")

    async def late():
        with pytest.raises(InvalidField, match="took over"):
            await c.compile(so)  # NOTE: the caller gives up; the compile runs on
        while c._jobs:
            await asyncio.sleep(0.01)
        c.timeout = 60.0
        return await c.compile(so)

    assert asyncio.run(late()) is not None and c.num_compiled == 1  # the outcome was cached when it came
    c.close()
