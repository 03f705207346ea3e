"""Grammar token bitmasks applied to logits (kernels/token_bitmask.py): each implementation (the C++
op, plain torch, the Triton kernel) against the mask's meaning worked out token by token in plain
Python, bit for bit, and `apply_token_bitmask_`'s choice among them and its argument checks.

Without CUDA the Triton kernel runs in Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1), with small blocks so that a row spans several programs; shapes stay small, as
the interpreter runs every program in numpy, one after the other.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kernels import token_bitmask
from kernels.build import cpu_kernels_available
from kernels.token_bitmask import apply_token_bitmask_, apply_token_bitmask_torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# The same bits as integers, to compare results bit for bit (-inf, -0.0 and all).
SAME_WIDTH_INT = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def run_cpp(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None) -> None:
    if not cpu_kernels_available():
        pytest.skip("the C++ CPU kernels could not be built here")
    torch.ops.raypage.apply_token_bitmask(logits, bitmask, rows)


def run_torch(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None) -> None:
    apply_token_bitmask_torch(logits, bitmask, rows)


def run_triton(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None) -> None:
    try:
        from kernels.triton_bitmask import kernel_interpreted, triton_apply_token_bitmask_
    except ImportError:
        pytest.skip("triton is not installed")
    if not (torch.cuda.is_available() or kernel_interpreted()):
        pytest.skip("no CUDA, and Triton's interpreter was not switched on before triton was imported")
    on_device = logits.to(DEVICE)
    # 4 words (128 tokens) a program: several programs a row, the mask's end inside one of them.
    triton_apply_token_bitmask_(
        on_device, bitmask.to(DEVICE), None if rows is None else rows.to(DEVICE), words_per_block=4
    )
    logits.copy_(on_device)


IMPLEMENTATIONS: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], None]] = {
    "cpp": run_cpp,
    "torch": run_torch,
    "triton": run_triton,
}


def expected_logits(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """logits with -inf at every token its mask row does not allow, decided one token at a time from
    the words as Python integers (two's complement, so bit 31 of a negative word reads as set)."""
    out = logits.clone()
    masks = bitmask.tolist()
    targets = list(range(len(masks))) if rows is None else rows.tolist()
    row_ids, token_ids = [], []
    for row, words in zip(targets, masks, strict=True):
        for token in range(logits.shape[1]):
            word = token // 32
            if word >= len(words) or not (words[word] >> (token % 32)) & 1:
                row_ids.append(row)
                token_ids.append(token)
    out[row_ids, token_ids] = float("-inf")
    return out


def pack(allowed: torch.Tensor) -> torch.Tensor:
    """[n, 32 * words] booleans -> int32 [n, words], token t at bit t % 32 of word t // 32."""
    n, tokens = allowed.shape
    weights = torch.ones(32, dtype=torch.int64) << torch.arange(32)
    words = (allowed.view(n, tokens // 32, 32).long() * weights).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def make_masks(n: int, words: int, seed: int) -> torch.Tensor:
    """n mask rows cycling through the shapes a grammar gives: all allowed, none allowed, about 1%
    allowed, words alternately all ones, all zeros and mixed (bit 31 alone, all but bit 31, bit 0
    alone, random), and uniformly random words."""
    gen = torch.Generator().manual_seed(seed)
    random_words = torch.randint(-(2**31), 2**31, (n, words), generator=gen, dtype=torch.int64)
    sparse = pack(torch.rand(n, 32 * words, generator=gen) < 0.01)
    specials = torch.tensor([-1, 0, -(2**31), 2**31 - 1, 1], dtype=torch.int64)
    masks = torch.empty(n, words, dtype=torch.int32)
    for i in range(n):
        kind = i % 5
        if kind == 0:
            masks[i] = -1
        elif kind == 1:
            masks[i] = 0
        elif kind == 2:
            masks[i] = sparse[i]
        elif kind == 3:
            alternating = specials.repeat(-(-words // len(specials)))[:words]
            masks[i] = torch.where(torch.arange(words) % 7 == 6, random_words[i], alternating).to(torch.int32)
        else:
            masks[i] = random_words[i].to(torch.int32)
    return masks


def assert_bit_identical(got: torch.Tensor, want: torch.Tensor) -> None:
    int_dtype = SAME_WIDTH_INT[got.dtype]
    assert torch.equal(got.view(int_dtype), want.view(int_dtype))


# (logits rows, vocab, mask rows, words, rows the masks apply to or None)
CASES = {
    # A vocabulary that is not a multiple of 32: the last word straddles its end.
    "vocab-1000": (5, 1000, 5, 32, None),
    "vocab-1024": (5, 1024, 5, 32, None),
    # Tokens 640 and up lie past the mask: all -inf.
    "mask-narrower": (5, 1000, 5, 20, None),
    # Bits for tokens 1000 and up are ignored (random ones are set).
    "mask-wider": (5, 1000, 5, 40, None),
    # A subset of the rows in shuffled order: the others stay as they were.
    "rows-subset": (9, 333, 5, 11, [7, 0, 4, 5, 2]),
    "vocab-5": (5, 5, 5, 1, None),
}


@pytest.mark.parametrize("implementation", list(IMPLEMENTATIONS))
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_the_mask_token_by_token(case: str, dtype: torch.dtype, implementation: str) -> None:
    num_rows, vocab, n, words, row_list = CASES[case]
    gen = torch.Generator().manual_seed(vocab + words)
    # The logits are a view into wider rows: nothing may be written past a row's vocab.
    storage = torch.randn(num_rows, vocab + 7, generator=gen).to(dtype)
    logits = storage[:, :vocab]
    bitmask = make_masks(n, words, seed=words)
    rows = None if row_list is None else torch.tensor(row_list)
    want = expected_logits(logits, bitmask, rows)
    padding = storage[:, vocab:].clone()
    IMPLEMENTATIONS[implementation](logits, bitmask, rows)
    assert_bit_identical(logits, want)
    assert_bit_identical(storage[:, vocab:], padding)


@pytest.mark.parametrize("implementation", list(IMPLEMENTATIONS))
def test_no_mask_rows_change_nothing(implementation: str) -> None:
    logits = torch.randn(4, 100)
    before = logits.clone()
    IMPLEMENTATIONS[implementation](
        logits, torch.zeros(0, 4, dtype=torch.int32), torch.zeros(0, dtype=torch.long)
    )
    assert_bit_identical(logits, before)
    empty = torch.zeros(0, 100)
    IMPLEMENTATIONS[implementation](empty, torch.zeros(0, 4, dtype=torch.int32), None)


def test_the_cpp_op_refuses_rows_outside_logits() -> None:
    if not cpu_kernels_available():
        pytest.skip("the C++ CPU kernels could not be built here")
    logits = torch.randn(3, 64)
    with pytest.raises(RuntimeError, match="outside logits"):
        apply_token_bitmask_(logits, torch.zeros(2, 2, dtype=torch.int32), torch.tensor([0, 3]))


def test_the_triton_kernel_skips_rows_outside_logits() -> None:
    logits = torch.randn(3, 64)
    before = logits.clone()
    run_triton(logits, torch.zeros(2, 2, dtype=torch.int32), torch.tensor([3, -1]))
    assert_bit_identical(logits, before)


def test_the_public_function_uses_the_cpp_op_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    if not cpu_kernels_available():
        pytest.skip("the C++ CPU kernels could not be built here")

    def refuse(*args: object) -> None:
        raise AssertionError("the torch path ran where the C++ op should have")

    monkeypatch.setattr(token_bitmask, "apply_token_bitmask_torch", refuse)
    logits = torch.randn(6, 300, dtype=torch.bfloat16)
    bitmask = make_masks(3, 10, seed=1)
    # int32 rows, and a mask whose rows are strided (a slice of wider ones): both taken as they are.
    wide_mask = torch.cat([bitmask, bitmask], dim=1)
    rows = torch.tensor([5, 1, 2], dtype=torch.int32)
    want = expected_logits(logits, bitmask, rows)
    assert apply_token_bitmask_(logits, wide_mask[:, :10], rows) is logits
    assert_bit_identical(logits, want)


def test_without_the_kernels_plain_torch_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(token_bitmask, "cpu_kernels_available", lambda: False)
    logits = torch.randn(5, 200)
    bitmask = make_masks(5, 7, seed=2)
    want = expected_logits(logits, bitmask, None)
    apply_token_bitmask_(logits, bitmask)
    assert_bit_identical(logits, want)


def test_other_dtypes_and_layouts_go_through_torch() -> None:
    bitmask = make_masks(4, 4, seed=3)
    logits64 = torch.randn(4, 120, dtype=torch.float64)
    want = expected_logits(logits64, bitmask, None)
    apply_token_bitmask_(logits64, bitmask)
    assert torch.equal(logits64, want)
    # Columns two elements apart, and a mask stored column-major.
    storage = torch.randn(4, 240)
    strided = storage[:, ::2]
    want = expected_logits(strided, bitmask, None)
    apply_token_bitmask_(strided, bitmask.t().contiguous().t())
    assert_bit_identical(strided, want)


@pytest.mark.parametrize(
    ("logits", "bitmask", "rows", "message"),
    [
        (torch.randn(2, 64), torch.zeros(2, 2, dtype=torch.int64), None, "bitmask must be int32"),
        (torch.randn(2, 64), torch.zeros(2, 2, dtype=torch.int32).view(-1), None, "bitmask must be int32"),
        (torch.randn(3, 64), torch.zeros(2, 2, dtype=torch.int32), None, "one row per logits row"),
        (torch.randn(3, 64), torch.zeros(2, 2, dtype=torch.int32), torch.tensor([0]), "one per mask row"),
        (torch.randn(3, 64), torch.zeros(1, 2, dtype=torch.int32), torch.tensor([0.0]), "integer indices"),
        (torch.zeros(3, 64, dtype=torch.long), torch.zeros(3, 2, dtype=torch.int32), None, "floating-point"),
    ],
    ids=["int64-mask", "1d-mask", "rows-missing", "rows-short", "float-rows", "int-logits"],
)
def test_arguments_no_implementation_takes_are_refused(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        apply_token_bitmask_(logits, bitmask, rows)
