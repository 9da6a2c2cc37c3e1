"""N-gram (prompt-lookup) proposals: the tokens that followed a sequence's last n tokens where they occurred before."""

from __future__ import annotations

from array import array
from collections.abc import Sequence

_WIDTH = 4  # bytes a token: array('i')


def propose(token_ids: Sequence[int], num_tokens: int, max_n: int, min_n: int) -> list[int]:
    """Up to `num_tokens` tokens guessed to follow `token_ids`: for n from max_n down to min_n, the last n tokens'
    latest earlier occurrence in `token_ids` (prompt and outputs alike), and the tokens that followed it there. []
    when no n-gram of those lengths occurred before (or num_tokens < 1).

    NOTE: searched as bytes (bytes.rfind, in C): a step proposes for every decoding sequence, and a Python loop over
    a 2,000-token sequence costs ~100 us. A byte match that does not start on a token boundary is skipped.
    """
    total = len(token_ids)
    if num_tokens < 1 or total <= min_n:
        return []
    data = token_ids.tobytes() if type(token_ids) is array and token_ids.typecode == "i" else \
        array("i", token_ids).tobytes()
    # An occurrence must end before the last token, so that at least one token follows it.
    stop = (total - 1) * _WIDTH
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        pattern = data[(total - n) * _WIDTH:]
        end = stop
        while (at := data.rfind(pattern, 0, end)) >= 0 and at % _WIDTH:
            end = at + len(pattern) - 1  # the next match leftwards starts before `at`
        if at >= 0:
            start = at // _WIDTH + n
            return list(token_ids[start:start + num_tokens])
    return []
