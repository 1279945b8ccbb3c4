"""Where a response writes its final answer, read back: the last `\\boxed{...}`, ORZ's
`<answer>` tag, "the answer is ...", or the last number (names in EXTRACTORS).

    extract_answer(text)                           # boxed, then the answer tag: None if neither
    extract_answer(text, ("answer_tag", "answer_is"))

The templates (orz.data.templates) ask for these forms; the verifiers (orz.reward) and the
synthetic tasks read them with this one function.
"""
from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable, Sequence

from orz.data.templates import ANSWER_CLOSE, ANSWER_OPEN


def _skip_group(text: str, start: int) -> int | None:
    """Index just past the brace group opening at text[start] == "{", or None if it never closes.
    Iterative and linear, so deeply nested or huge inputs cannot blow the stack."""
    depth = 0
    i = start
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2  # \{ and \} are literal braces, not grouping
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


_BOXED = re.compile(r"\\(?:boxed|fbox)(?![a-zA-Z])")
_BARE_ARGUMENT = re.compile(r"\s+([^\s$]+)")


def _last_match(pattern: re.Pattern, text: str) -> re.Match | None:
    tail = deque(pattern.finditer(text), maxlen=1)
    return tail[0] if tail else None


def _last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}`, `\\fbox{...}` or `\\boxed x`; None if it never closes."""
    last = _last_match(_BOXED, text)
    if last is None:
        return None
    after = last.end()
    if text.startswith("{", after):
        end = _skip_group(text, after)
        return text[after + 1 : end - 1] if end is not None else None
    bare = _BARE_ARGUMENT.match(text, after)
    return bare.group(1) if bare else None


def _last_answer_tag(text: str) -> str | None:
    """Content of ORZ's last closed `<answer>...</answer>` tag."""
    start = text.rfind(ANSWER_OPEN)
    if start < 0:
        return None
    end = text.find(ANSWER_CLOSE, start)
    return text[start + len(ANSWER_OPEN) : end] if end >= 0 else None


_ANSWER_IS = re.compile(r"(?:final answer|the answer)\s*(?:is|:)\s*:?\s*([^\n]+)", re.IGNORECASE)


def _answer_is(text: str) -> str | None:
    """What follows the last "the answer is" / "final answer:" on its line."""
    last = _last_match(_ANSWER_IS, text)
    return last.group(1) if last else None


_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?")


def _last_number(text: str) -> str | None:
    last = _last_match(_NUMBER, text)
    return last.group(0) if last else None


EXTRACTORS: dict[str, Callable[[str], str | None]] = {
    "boxed": _last_boxed,
    "answer_tag": _last_answer_tag,
    "answer_is": _answer_is,
    "last_number": _last_number,
}
# Only explicit answer markers by default: a "last number" fallback rewards lucky guesses.
DEFAULT_EXTRACTION = ("boxed", "answer_tag")

_MATH_DELIMITERS = (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"))


def _clean(answer: str) -> str:
    """Strips whitespace, outer math delimiters and a sentence's final period."""
    answer = answer.strip()
    for left, right in _MATH_DELIMITERS:
        if len(answer) > len(left) + len(right) and answer.startswith(left) and answer.endswith(right):
            answer = answer[len(left) : -len(right)].strip()
            break
    return answer.removesuffix(".").strip()


def extract_answer(text: str, extraction: Sequence[str] = DEFAULT_EXTRACTION) -> str | None:
    """The final answer of a response: the first of `extraction`'s forms (names in EXTRACTORS)
    that the response contains, or None. A boxed answer inside the answer tag wins either way."""
    for name in extraction:
        if name not in EXTRACTORS:
            raise ValueError(f"unknown answer form {name!r}; valid: {sorted(EXTRACTORS)}")
        found = EXTRACTORS[name](text)
        if found is not None and (answer := _clean(found)):
            return answer
    return None
