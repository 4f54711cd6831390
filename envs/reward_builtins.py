"""The built-in rewards (``env.reward=math``, ``exact``, ``strict``, ``em``, ``f1``,
``choice``, ``regex``, ``format``), each in our convention ``fn(completion, answer, metadata)``;
what each scores is in :mod:`envs.rewards`' docstring and docs/environments.md. ``math`` runs in
the reward workers (math-verify's parser can hang); its :func:`math_quick` decides in the caller
what needs no parser."""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from envs.answers import extract_final, extract_math, last_boxed, last_tagged, normalise


class RewardTimeout(TimeoutError):
    """A reward's own time limit ran out (math-verify's alarm): counted as ``own_timeout``."""




def _as_boxed(text: str) -> str:
    text = text.strip()
    if "\\boxed" in text or "\\fbox" in text:
        return text
    if len(text) >= 2 and text[0] == text[-1] == "$":
        text = text.strip("$")
    return f"\\boxed{{{text}}}"


def math_reward(completion: str, answer: str, metadata: Mapping[str, Any]) -> float:
    from math_verify import parse, verify
    from math_verify.errors import TimeoutException

    extracted = extract_math(completion)
    if extracted is None:
        return 0.0
    if normalise(extracted) == normalise(answer):
        return 1.0
    limit = _MATH_VERIFY_TIMEOUT
    try:  # raise_on_error: its own timeout must surface (a failure), not read as "not equal"
        gold = parse(_as_boxed(answer), parsing_timeout=limit, raise_on_error=True)
        guess = parse(_as_boxed(extracted), parsing_timeout=limit, raise_on_error=True)
        if not gold or not guess:
            return 0.0
        return 1.0 if verify(gold, guess, timeout_seconds=limit, raise_on_error=True) else 0.0
    except TimeoutException as e:
        raise RewardTimeout(f"math-verify's own timeout ({limit} s)") from e
    except Exception:  # noqa: BLE001 - a reply (or answer) math-verify cannot read scores 0
        return 0.0


def set_math_verify_timeout(seconds: int) -> None:
    global _MATH_VERIFY_TIMEOUT
    _MATH_VERIFY_TIMEOUT = seconds


def warm_up(names: Sequence[str]) -> None:
    """Import what the built-ins among ``names`` import on first use (in the zygote, once)."""
    if "math" in names:
        math_reward("\\boxed{\\frac{1}{2}}", "0.5", {})


def exact_reward(completion: str, answer: str, metadata: Mapping[str, Any]) -> float:
    return 1.0 if normalise(extract_final(completion)) == normalise(answer) else 0.0


def strict_reward(completion: str, answer: str, metadata: Mapping[str, Any]) -> float:
    return 1.0 if completion.strip() == answer else 0.0


def squad_normalise(text: str) -> str:
    """SQuAD-style: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in string.punctuation)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def em_reward(completion: str, answer: str, metadata: Mapping[str, Any]) -> float:
    return float(squad_normalise(completion) == squad_normalise(answer))


def f1_reward(completion: str, answer: str, metadata: Mapping[str, Any]) -> float:
    pred, gold = squad_normalise(completion).split(), squad_normalise(answer).split()
    common = sum((Counter(pred) & Counter(gold)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(gold)
    return 2 * precision * recall / (precision + recall)


_LETTER = re.compile(r"^\(?([A-Za-z])\)?(?:[.):\s]|$)")
_ANSWER_IS = re.compile(r"answer\s*(?:is|:)\s*\(?([A-Z])\b\)?", re.IGNORECASE)


def _letter(text: str) -> str | None:
    match = _LETTER.match(text.strip())
    return match.group(1).upper() if match else None


def choice_reward(completion: str, answer: str, metadata: Mapping[str, Any]) -> float:
    reference = _letter(answer)
    if reference is None:
        return 0.0
    picked = None
    for found in (last_boxed(completion), last_tagged(completion)):
        if found:
            picked = _letter(found)
            break
    if picked is None:
        stated = _ANSWER_IS.findall(completion)
        if stated:
            picked = stated[-1].upper()
        elif len(completion.strip()) <= 3:
            picked = _letter(completion)
    return 1.0 if picked == reference else 0.0


def regex_reward(completion: str, answer: str, metadata: Mapping[str, Any]) -> float:
    return 1.0 if re.fullmatch(answer, extract_final(completion), flags=re.DOTALL) else 0.0


def format_reward(completion: str, answer: str, metadata: Mapping[str, Any]) -> float:
    return 1.0 if last_boxed(completion) or last_tagged(completion) else 0.0


_PLAIN_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _plain_number(text: str) -> float | None:
    text = text.strip().strip("$").strip()
    return float(text) if _PLAIN_NUMBER.fullmatch(text) else None


def math_quick(completion: str, answer: str) -> float | None:
    """``math``'s score where it needs no parser (so cannot hang): nothing extractable (0),
    the same text (1), two plain decimal numbers (compared as numbers); else None."""
    extracted = extract_math(completion)
    if extracted is None:
        return 0.0
    if normalise(extracted) == normalise(answer):
        return 1.0
    guess, gold = _plain_number(extracted), _plain_number(answer)
    if guess is None or gold is None:
        return None
    return 1.0 if math.isclose(guess, gold, rel_tol=1e-9, abs_tol=1e-12) else 0.0


@dataclass(frozen=True)
class Builtin:
    fn: Callable[[str, str, Mapping[str, Any]], float]
    isolated: bool  # may hang or crash on a model's output: runs in a worker process
    # an isolated built-in's score in the caller where it is certain without the risky part
    quick: Callable[[str, str], float | None] | None = None


BUILTINS: dict[str, Builtin] = {
    "math": Builtin(math_reward, isolated=True, quick=math_quick),
    "exact": Builtin(exact_reward, isolated=False),
    "strict": Builtin(strict_reward, isolated=False),
    "em": Builtin(em_reward, isolated=False),
    "f1": Builtin(f1_reward, isolated=False),
    "choice": Builtin(choice_reward, isolated=False),
    "regex": Builtin(regex_reward, isolated=True),
    "format": Builtin(format_reward, isolated=False),
}
_MATH_VERIFY_TIMEOUT = 5  # seconds, math-verify's own alarm in a worker (set by the pool)
