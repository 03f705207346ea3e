"""Logprobs as vLLM returns them: per position, a dict token id -> `Logprob`, the chosen token first.

The sampler gives each position as one row: column 0 is the chosen token (sampled, or the prompt's
own), then the top-k tokens in descending order. `make_logprobs_dict` turns a row into vLLM's dict.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
from tokenizers import Tokenizer

_REPLACEMENT_CHAR = "\ufffd"
# A UTF-8 character is at most 4 bytes, so at most 4 preceding tokens can hold the rest of it.
_MAX_CONTEXT_TOKENS = 4


class Logprob(msgspec.Struct, gc=False):
    """One token's log probability, its rank in the vocabulary (1 = most likely) and its text.

    vLLM's fields and defaults. `gc=False`: a long generation with top-k logprobs makes many of
    these, and holding only numbers and strings they can never be part of a reference cycle.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def _decode(tokenizer: Tokenizer, token_ids: list[int]) -> str:
    return tokenizer.decode(token_ids, skip_special_tokens=False)


def decode_logprob_token(tokenizer: Tokenizer, token_id: int, context_token_ids: Sequence[int] = ()) -> str:
    """The text of one token as vLLM reports it in logprobs.

    `tokenizer.decode([token_id])`, special tokens kept. A token holding only part of a multi-byte
    character decodes alone to U+FFFD; as in vLLM, it is decoded again after up to 4 of the tokens
    chosen at the preceding positions (`context_token_ids`, oldest first): if that completes the
    character, the token's text is the character (with the bytes of preceding tokens that were
    themselves incomplete, since those reported ""); if not, it is "".
    """
    text = _decode(tokenizer, [token_id])
    if not text.endswith(_REPLACEMENT_CHAR):
        return text
    context = list(context_token_ids[-_MAX_CONTEXT_TOKENS:])
    for num_context in range(1, len(context) + 1):
        window = context[-num_context:]
        joined = _decode(tokenizer, [*window, token_id])
        if joined.endswith(_REPLACEMENT_CHAR):
            continue  # still incomplete: reach further back
        # Preceding tokens that end inside this same character reported "": their text is ours.
        clean_end = len(window)
        while clean_end > 0 and _decode(tokenizer, [window[clean_end - 1]]).endswith(_REPLACEMENT_CHAR):
            clean_end -= 1
        clean_prefix = _decode(tokenizer, window[:clean_end]) if clean_end else ""
        # The common prefix rather than startswith: decoders that normalize text (e.g. strip a
        # leading space) may decode the prefix alone slightly differently.
        shared = 0
        while shared < min(len(clean_prefix), len(joined)) and clean_prefix[shared] == joined[shared]:
            shared += 1
        return joined[shared:]
    return ""


def make_logprobs_dict(
    tokenizer: Tokenizer,
    token_ids: Sequence[int],
    logprobs: Sequence[float],
    rank_of_first: int,
    num_logprobs: int,
    context_token_ids: Sequence[int] = (),
) -> dict[int, Logprob]:
    """vLLM's logprobs of one position: the chosen token, then the top `num_logprobs` tokens.

    `token_ids` / `logprobs` are the position's row: column 0 the chosen token, whose rank is
    `rank_of_first`, then the top-k in descending order (ranks 1..k); columns past
    `num_logprobs` are ignored (a batch's rows are as wide as its largest request). When the chosen
    token is also in the top-k it has one entry, first, holding the top-k column's values, exactly
    as vLLM's dict comprehension does. `context_token_ids` are the tokens chosen at the preceding
    positions (oldest first), used to decode tokens that end inside a character
    (see `decode_logprob_token`).
    """
    if len(token_ids) != len(logprobs):
        raise ValueError(f"token_ids and logprobs differ in length: {len(token_ids)} != {len(logprobs)}.")
    if not 0 <= num_logprobs < len(token_ids):
        raise ValueError(
            f"num_logprobs must be in [0, {len(token_ids) - 1}] for a row of {len(token_ids)} columns, "
            f"got {num_logprobs}."
        )
    ranks = (rank_of_first, *range(1, num_logprobs + 1))
    result: dict[int, Logprob] = {}
    # Not strict: `ranks` is shorter than a row wider than the request asked for, and ends the loop.
    for token_id, logprob, rank in zip(token_ids, logprobs, ranks, strict=False):
        result[int(token_id)] = Logprob(
            logprob=float(logprob),
            rank=rank,
            decoded_token=decode_logprob_token(tokenizer, int(token_id), context_token_ids),
        )
    return result
