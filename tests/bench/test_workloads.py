"""Workloads: seeded and exact (same bytes for the same seed, lengths inside their ranges), and the JSONL loader."""

from __future__ import annotations

import json

import pytest

from pagedserve_cli.bench import workloads
from pagedserve_cli.bench.workloads import (WORKLOADS, BenchRequest, build_workload, dump_jsonl, load_jsonl,
                                            parse_range)


def as_bytes(reqs: list[BenchRequest]) -> bytes:
    return "".join(json.dumps(r.to_json()) + "\n" for r in reqs).encode()


@pytest.mark.parametrize("name", WORKLOADS)
def test_same_seed_same_bytes_other_seed_other_bytes(tok, name):
    a = build_workload(name, tok, 24, seed=7, max_model_len=8192)
    assert as_bytes(a) == as_bytes(build_workload(name, tok, 24, seed=7, max_model_len=8192))
    assert as_bytes(a) != as_bytes(build_workload(name, tok, 24, seed=8, max_model_len=8192))
    assert len(a) == 24 and all(r.prompt is None for r in a)


def test_overrides_draw_inside_the_ranges_exactly(tok):
    reqs = build_workload("mixed", tok, 300, seed=1, prompt_len=(32, 256), output_len=(16, 128))
    prompts, outputs = [r.prompt_len for r in reqs], [r.max_tokens for r in reqs]
    assert min(prompts) >= 32 and max(prompts) <= 256 and min(outputs) >= 16 and max(outputs) <= 128
    # Uniform, not a constant: the draws spread over most of each range.
    assert max(prompts) - min(prompts) > 150 and max(outputs) - min(outputs) > 80
    assert all(len(r.prompt_token_ids) == r.prompt_len for r in reqs)
    special = tok.all_special_ids
    assert not any(t in special for r in reqs for t in r.prompt_token_ids)


def test_default_lengths_are_clipped_to_the_model(tok):
    reqs = build_workload("mixed", tok, 300, seed=2, max_model_len=100)
    assert all(16 <= r.prompt_len <= 50 and 16 <= r.max_tokens <= 256 for r in reqs)
    reqs = build_workload("mixed", tok, 300, seed=2, max_model_len=8192)
    assert all(16 <= r.prompt_len <= 1024 for r in reqs)
    assert len({r.prompt_len for r in reqs}) > 50  # long-tailed, not a handful of values


def test_prompts_are_english_text_that_rarely_share_a_prefix(tok):
    reqs = build_workload("mixed", tok, 64, seed=3, prompt_len=(40, 40))
    text = tok.decode(list(reqs[0].prompt_token_ids))
    assert sum(c.isalpha() for c in text) > len(text) / 2
    assert len({r.prompt_token_ids[:16] for r in reqs}) > 56


def test_shared_prefix_one_system_prompt_and_short_user_turns(tok):
    reqs = build_workload("shared-prefix", tok, 40, seed=4, max_model_len=8192)
    assert len({r.prompt_token_ids[:1000] for r in reqs}) == 1
    assert all(1000 + 32 <= r.prompt_len <= 1000 + 96 for r in reqs)
    assert len({r.prompt_token_ids[1000:] for r in reqs}) == 40
    small = build_workload("shared-prefix", tok, 4, seed=4, max_model_len=512)
    assert all(256 + 32 <= r.prompt_len <= 256 + 96 for r in small)  # the system prompt shrinks to fit


def test_multi_tenant_distinct_system_prompts(tok):
    reqs = build_workload("multi-tenant", tok, 64, seed=5, num_tenants=3, prompt_len=(10, 10), max_model_len=8192)
    assert len({r.prompt_token_ids[:500] for r in reqs}) == 3
    assert all(r.prompt_len == 510 for r in reqs)


def test_edit_asks_to_correct_a_misspelt_passage_and_leaves_room_to_copy_it(tok):
    reqs = build_workload("edit", tok, 16, seed=6, max_model_len=2048)
    for r in reqs:
        text = tok.decode(list(r.prompt_token_ids))
        assert text.startswith("Correct the spelling mistakes") and text.endswith("\n\nCorrected text:")
        passage = text.split("Text: ", 1)[1].rsplit("\n\n", 1)[0]
        assert 64 <= len(tok.encode(" " + passage, add_special_tokens=False)) + 8 == r.max_tokens <= 192 + 64
    words = " ".join(tok.decode(list(r.prompt_token_ids)).split("Text: ", 1)[1].rsplit("\n\n", 1)[0]
                     for r in reqs).split()
    typos = sum(w.strip(".,") not in workloads._TEXT for w in words)
    assert len(words) / 100 < typos < len(words) / 10  # a few words misspelt, the rest the built-in text
    small = build_workload("edit", tok, 4, seed=6, max_model_len=384)
    assert all(r.prompt_len + r.max_tokens <= 384 for r in small)


def test_jsonl_round_trip_and_text_prompts(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt": "Hello there", "max_tokens": 5}\n\n{"prompt_token_ids": [1, 2, 3], "max_tokens": 7}\n'
                    '{"prompt": "again", "max_tokens": 1}\n')
    reqs = load_jsonl(path)
    assert reqs == [BenchRequest(5, prompt="Hello there"), BenchRequest(7, (1, 2, 3)), BenchRequest(1, prompt="again")]
    assert [r.prompt_len for r in reqs] == [None, 3, None]
    assert load_jsonl(path, num_requests=2) == reqs[:2]
    dump_jsonl(reqs, tmp_path / "again.jsonl")
    assert load_jsonl(tmp_path / "again.jsonl") == reqs


@pytest.mark.parametrize("line, message", [
    ('{"prompt": "x"}', "w.jsonl:2: needs max_tokens"),
    ('{"prompt": "x", "prompt_token_ids": [1], "max_tokens": 3}', "w.jsonl:2: needs exactly one"),
    ('{"max_tokens": 3}', "w.jsonl:2: needs exactly one"),
    ('{"prompt": "x", "max_tokens": 0}', "w.jsonl:2: max_tokens must be at least 1"),
    ("not json", "w.jsonl:2:"),
])
def test_jsonl_errors_name_the_line(tmp_path, line, message):
    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt": "fine", "max_tokens": 2}\n' + line + "\n")
    with pytest.raises(ValueError, match=message):
        load_jsonl(path)


def test_parse_range():
    assert parse_range("32:256") == (32, 256) and parse_range("5:5") == (5, 5)
    for bad in ("32", "a:b", "9:3", "0:4", "1:2:3"):
        with pytest.raises(ValueError):
            parse_range(bad)
