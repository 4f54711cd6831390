"""Reading a reply's final answer: the last ``\\boxed{…}``, ``<answer>…</answer>`` tags, the last
number. The rewards of :mod:`envs.rewards` compare what these find with the reference, and
:meth:`envs.base.EnvSpec.extract_answer` (an evaluation's majority vote, maj@n) uses
:func:`extract_math` where an environment gives no extractor of its own. Plain text in, plain
text out: nothing here imports the rest of the package."""

from __future__ import annotations

import re

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*")


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{…}`` / ``\\fbox{…}`` (braces matched), or of a
    ``\\boxed 5`` without braces; None when there is none or it is not closed."""
    starts = [m for m in _BOXED.finditer(text)]
    for match in reversed(starts):
        i = match.end()
        if i < len(text) and text[i] == "{":
            depth = 0
            for j in range(i, len(text)):
                if text[j] == "{":
                    depth += 1
                elif text[j] == "}":
                    depth -= 1
                    if depth == 0:
                        return text[i + 1:j].strip()
            continue  # never closed: try an earlier one
        rest = text[i:].split()
        if rest and match.group().endswith(" "):
            return rest[0].rstrip(".$")
    return None


def last_tagged(text: str) -> str | None:
    tagged = _ANSWER_TAG.findall(text)
    return tagged[-1].strip() if tagged else None


def last_number(text: str) -> str | None:
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


def extract_math(text: str) -> str | None:
    """``math``'s answer: the last ``\\boxed{}``, else the last ``<answer>`` tags, else the
    last number; None when the reply has none of them."""
    for extract in (last_boxed, last_tagged, last_number):
        found = extract(text)
        if found:
            return found
    return None


def extract_final(text: str) -> str:
    """``exact`` and ``regex``'s answer: boxed, else tagged, else the whole reply, stripped."""
    return last_boxed(text) or last_tagged(text) or text.strip()


def normalise(text: str) -> str:
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] == "$":
        text = text.strip("$")
    text = re.sub(r"\s+", " ", text.strip()).lower()
    return text[:-1].rstrip() if text.endswith(".") else text
