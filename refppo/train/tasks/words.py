"""A tiny synthetic "review" language: a word-level vocabulary, a prompt generator and a hidden rule.

Prompts are short noun phrases such as ``review : the plot`` (2–5 words after ``review :``);
responses are short word sequences ending in ``<eos>``. The hidden rule that labels the reward
model's preference pairs (and is the programmatic reward, ``task.reward = "rule"``)::

    score(response) = (#positive − #negative words) / #words          ∈ [−1, 1]

The GRPO demo's verifiable reward (:func:`verify_reward`) also reads the prompt: half a point for
a positive response, half for naming the prompt's subject noun.

(a response truncated without ``<eos>`` additionally loses ``rollout.missing_eos_penalty``).

The warm-start data mixes positive, negative and neutral words with a random per-sample tilt, so
the warm-started policy's mean score is ≈ 0 with a wide spread — room for PPO to raise it.

The tokenizer is a real ``transformers.PreTrainedTokenizerFast`` (a ``tokenizers`` WordLevel
model built in code), so it saves/loads with ``AutoTokenizer`` like any other; ids 0/1/2 are
pad/bos/eos as in :mod:`refppo.models`.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

SPECIAL = ["<pad>", "<bos>", "<eos>", "<unk>"]
POSITIVE = ["good", "great", "happy", "nice", "love", "fun", "superb", "lovely"]
NEGATIVE = ["bad", "awful", "sad", "boring", "hate", "ugly", "dull", "poor"]
NEUTRAL = [
    "the", "a", "it", "and", "was", "is", "very", "quite", "really", "this", "i", "my", "we",
    "felt", "think", "saw", "so", "but", "then", "end",
]  # fmt: skip
NOUNS = ["movie", "film", "book", "story", "plot", "music", "actors", "ending", "show", "song"]
PROMPT_HEAD = ["review", ":"]
VOCAB = SPECIAL + PROMPT_HEAD + NOUNS + NEUTRAL + POSITIVE + NEGATIVE
"""Every word; its index is its token id."""

_POS, _NEG = frozenset(POSITIVE), frozenset(NEGATIVE)


def build_tokenizer() -> Any:
    """A ``PreTrainedTokenizerFast`` over :data:`VOCAB` (whitespace split, pad/bos/eos/unk set)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    fast: Any = PreTrainedTokenizerFast  # untyped in transformers
    return fast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="left",
    )


def rule_score(response_words: Sequence[str]) -> float:
    """The hidden rule on a response's words (special tokens are ignored)."""
    words = [w for w in response_words if w not in SPECIAL]
    n = max(len(words), 1)
    return (sum(w in _POS for w in words) - sum(w in _NEG for w in words)) / n


def rule_reward(prompt: str, response: str) -> float:
    """The hidden rule as a text reward function (``--reward refppo.train.tasks.words:rule_reward``).

    ``response`` is the decoded response (words after an ``<eos>`` are ignored). A response
    truncated without ``<eos>`` is penalised by the rollout's ``missing_eos_penalty``, not here.
    """
    del prompt
    words = response.split()
    if "<eos>" in words:
        words = words[: words.index("<eos>")]
    return rule_score(words)


def prompt_subject(prompt: str) -> str | None:
    """The first noun of a prompt (``review : the plot`` → ``plot``), or None."""
    return next((w for w in prompt.split() if w in NOUNS), None)


def verify_reward(prompt: str, response: str) -> float:
    """A verifiable reward computed from the prompt (``--reward refppo.train.tasks.words:verify_reward``;
    the GRPO demo's). Graded in {0, ½, 1}::

        score = ½·[#positive > #negative words] + ½·[the prompt's subject noun is in the response]

    (words after ``<eos>`` ignored). Each half is a 0/1 check, so a group of responses to one
    prompt has a spread of scores for the group statistics to rank; the second half can only be
    met by reading the prompt."""
    words = response.split()
    if "<eos>" in words:
        words = words[: words.index("<eos>")]
    positive = sum(w in _POS for w in words) > sum(w in _NEG for w in words)
    subject = prompt_subject(prompt)
    return 0.5 * float(positive) + 0.5 * float(subject is not None and subject in words)


@dataclass(frozen=True)
class WordsTask:
    """Prompt and warm-start sample generator for the review language."""

    prompt_words: tuple[int, int] = (2, 5)
    """Inclusive range of words after ``review :``."""
    response_words: tuple[int, int] = (3, 10)
    """Inclusive range of warm-start response lengths (before ``<eos>``)."""

    def prompt(self, rng: random.Random) -> str:
        """One prompt, e.g. ``review : the film i saw``."""
        n = rng.randint(*self.prompt_words)
        words = [rng.choice(["the", "a", "my", "this"]), rng.choice(NOUNS)]
        words += [rng.choice(NEUTRAL + NOUNS) for _ in range(n - 2)]
        return " ".join(PROMPT_HEAD + words[:n])

    def prompts(self, n: int, rng: random.Random) -> list[str]:
        """``n`` prompts."""
        return [self.prompt(rng) for _ in range(n)]

    def response(self, rng: random.Random) -> str:
        """One warm-start response (ends with ``<eos>``), with a random sentiment tilt."""
        n = rng.randint(*self.response_words)
        tilt = rng.random()  # P(sentiment word is positive)
        words: list[str] = []
        for _ in range(n):
            if rng.random() < 0.5:
                words.append(rng.choice(NEUTRAL + NOUNS))
            else:
                words.append(rng.choice(POSITIVE if rng.random() < tilt else NEGATIVE))
        return " ".join([*words, "<eos>"])
