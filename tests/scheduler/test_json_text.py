"""JSON text a client or a model sends is parsed with its nesting bounded (issue 50): json.loads recurses once per
level, so 5,000 `[` were a RecursionError (a 500 with a traceback), and a deep schema recursed again in the grammar
compiler. Depth is measured without parsing, brackets inside strings aside."""

from __future__ import annotations

import json

import pytest

from scheduler_svc import json_text
from scheduler_svc.json_text import MAX_DEPTH, TooDeep, depth


@pytest.mark.parametrize("text, levels", [
    ("", 0), ("1", 0), ('"[[["', 0), ("[]", 1), ("[[], {}]", 2), ('{"a": [{"b": [1]}]}', 4),
    ('["[", "{{", "]]]"]', 1),  # brackets in strings do not count
    ('["a\\\\", ["\\"]"]]', 2),  # an escaped backslash ends before the quote; an escaped quote is inside
    ("[" * 100 + "]" * 100, 100), ("[" * 5000, 5000),  # unbalanced: still measured (json.loads refuses it)
])
def test_depth_is_the_deepest_nesting_outside_strings(text, levels):
    assert depth(text) == levels


def test_loads_parses_up_to_the_bound_and_refuses_past_it_as_a_value_error():
    deepest = "[" * MAX_DEPTH + "]" * MAX_DEPTH
    assert json_text.loads(deepest) == json.loads(deepest)
    for too_deep in ("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1), "[" * 5000, '{"a":' * 1200 + "1" + "}" * 1200):
        with pytest.raises(TooDeep, match=f"more than {MAX_DEPTH} levels"):
            json_text.loads(too_deep)
    assert issubclass(TooDeep, ValueError)  # callers that take "not JSON" as text do the same with it
