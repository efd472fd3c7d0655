"""User reward functions (refppo/train/reward_fn.py): what they receive, what they may return, and the
errors that tell a wrong signature apart from a bug inside the function (issue 12, items 4, 5, 12)."""

from __future__ import annotations

import fractions
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from refppo.train.reward_fn import RewardFunctionError, as_real, load_reward_function, text_reward
from refppo.train.tasks.words import build_tokenizer

TOK = build_tokenizer()
PROMPT = TOK("review : the film", add_special_tokens=False)["input_ids"]
EOS, PAD = int(TOK.eos_token_id), int(TOK.pad_token_id)
WORDS = TOK("great fun", add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize(
    ("value", "want"),
    [
        (0.5, 0.5),
        (3, 3.0),
        (np.float32(0.5), 0.5),
        (np.float16(-2.0), -2.0),
        (np.float64(1.25), 1.25),
        (np.int64(7), 7.0),
        (np.uint8(200), 200.0),
        (fractions.Fraction(1, 4), 0.25),
        (torch.tensor(0.75), 0.75),
        (torch.tensor(2, dtype=torch.int32), 2.0),
        (torch.tensor([1.5], dtype=torch.float64), 1.5),
        (torch.tensor(0.5, dtype=torch.bfloat16, requires_grad=True), 0.5),
        (np.array(0.25, dtype=np.float32), 0.25),
        (np.array([[4.0]]), 4.0),
    ],
    ids=lambda v: type(v).__name__,
)
def test_every_real_scalar_is_accepted(value: Any, want: float) -> None:
    got = as_real(value)
    assert isinstance(got, float) and got == want


@pytest.mark.parametrize(
    "value",
    [
        True,
        np.bool_(False),
        1 + 2j,
        np.complex64(1),
        "0.5",
        None,
        [0.5],
        torch.tensor([0.5, 0.5]),
        torch.tensor([]),
        torch.tensor(True),
        torch.tensor(1 + 1j),
        np.array([1.0, 2.0]),
        np.array("0.5"),
    ],
    ids=lambda v: f"{type(v).__name__}:{v!r}"[:40],
)
def test_non_real_results_are_refused(value: Any) -> None:
    assert as_real(value) is None


def test_np_float32_result_scores_and_non_finite_results_name_the_prompt() -> None:
    r = text_reward(lambda p, s: np.float32(0.5), TOK, name="mod:np32")
    assert r(PROMPT, [*WORDS, EOS]) == 0.5  # refused before issue 12 ("expected a number")
    for bad in (float("nan"), float("inf"), -np.inf, torch.tensor(float("nan"))):
        f = text_reward(lambda p, s, v=bad: v, TOK, name="mod:bad")
        with pytest.raises(
            RewardFunctionError, match=r"mod:bad returned (nan|inf|-inf) on the prompt 'review : the film'"
        ):
            f(PROMPT, [*WORDS, EOS])


def test_wrong_signature_is_refused_before_any_call() -> None:
    calls: list[str] = []

    def one_arg(prompt: str) -> float:
        calls.append(prompt)
        return 1.0

    def three_required(prompt: str, response: str, extra: str) -> float:
        calls.append(prompt)
        return 1.0

    for fn in (one_arg, three_required):
        with pytest.raises(RewardFunctionError, match=r"cannot be called as f\(prompt: str, response: str\)"):
            text_reward(fn, TOK)
    assert calls == []  # checked on the signature, not by calling it and catching TypeError

    # keyword-only extras with defaults, *args and callables objects are fine
    def kw(prompt: str, response: str, *, scale: float = 2.0) -> float:
        return scale

    class Scorer:
        def __call__(self, prompt: str, *rest: str) -> float:
            return float(len(rest))

    assert text_reward(kw, TOK)(PROMPT, WORDS) == 2.0
    assert text_reward(Scorer(), TOK)(PROMPT, WORDS) == 1.0


def test_type_error_inside_the_function_is_a_bug_report_not_a_signature_error(tmp_path: Path) -> None:
    """`len(response) + None` inside a well-formed function: reported as "raised TypeError" with the
    user's file and line, not blamed on the signature (the pre-issue-12 message)."""
    src = tmp_path / "buggy_reward_mod.py"
    src.write_text("def score(prompt, response):\n    n = len(response)\n    return n + None\n")
    sys.path.insert(0, str(tmp_path))
    try:
        f = load_reward_function("buggy_reward_mod:score", TOK)
        with pytest.raises(RewardFunctionError) as info:
            f(PROMPT, [*WORDS, EOS])
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("buggy_reward_mod", None)
    msg = str(info.value)
    first = msg.splitlines()[0]
    assert "buggy_reward_mod:score raised TypeError on the prompt 'review : the film'" in first
    assert "'great fun'" in first  # the response too
    assert "cannot be called" not in msg and "calling it as" not in msg
    assert f'File "{src}", line 3, in score' in msg and "return n + None" in msg
    assert "reward_fn.py" not in msg  # refppo's own frames are cut off


def test_key_error_names_the_prompt_and_shows_the_users_frames(tmp_path: Path) -> None:
    src = tmp_path / "keyerr_reward_mod.py"
    src.write_text(
        "TABLE = {}\n\ndef lookup(word):\n    return TABLE[word]\n\n"
        "def score(prompt, response):\n    return lookup(response)\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        f = load_reward_function("keyerr_reward_mod:score", TOK)
        long_prompt = TOK(" ".join(["review", ":"] + ["the"] * 60), add_special_tokens=False)["input_ids"]
        with pytest.raises(RewardFunctionError) as info:
            f(long_prompt, WORDS)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("keyerr_reward_mod", None)
    msg = str(info.value)
    assert "raised KeyError" in msg and "'great fun'" in msg
    assert "the the the" in msg and "…" in msg and len(msg.splitlines()[0]) < 400  # prompt truncated
    assert f'File "{src}", line 7, in score' in msg and f'File "{src}", line 4, in lookup' in msg
    assert msg.rstrip().endswith("KeyError: 'great fun'")
    assert isinstance(info.value.__cause__, KeyError)


def test_special_tokens_stripped_by_default_and_kept_on_request() -> None:
    """The response as sampled: words, a <pad> sampled mid-response, then EOS. By default the
    function sees neither (skip_special_tokens=True); keep_special_tokens=True spells them out."""
    seen: list[tuple[str, str]] = []

    def record(prompt: str, response: str) -> float:
        seen.append((prompt, response))
        return 0.0

    response = [WORDS[0], PAD, WORDS[1], EOS]
    text_reward(record, TOK)(PROMPT, response)
    text_reward(record, TOK, keep_special_tokens=True)(PROMPT, response)
    (p0, r0), (p1, r1) = seen
    assert p0 == p1 == "review : the film"
    assert r0 == "great fun"
    assert r1 == f"great {TOK.pad_token} fun {TOK.eos_token}"


def test_bos_prompt_is_stripped_by_default() -> None:
    bos = TOK.bos_token_id
    assert bos is not None
    seen: list[str] = []
    text_reward(lambda p, r: seen.append(p) or 0.0, TOK)([bos, *PROMPT], WORDS)
    text_reward(lambda p, r: seen.append(p) or 0.0, TOK, keep_special_tokens=True)([bos, *PROMPT], WORDS)
    assert seen == ["review : the film", f"{TOK.bos_token} review : the film"]
