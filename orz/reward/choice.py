"""Multiple-choice verdicts: the letter a response answers with, against the row's letter."""
from __future__ import annotations

import re
from collections.abc import Sequence

from orz.data.datasets import LETTERS
from orz.data.answers import extract_answer

# \text{C}, (C), C), C., "C: blah", "(C) blah"
_LETTER = re.compile(r"^\s*(?:\\(?:text|textbf|mathrm)\{\s*)?\(?\s*([A-J])\s*(?:\)|\}|\.|:|\s|$)")


def extract_choice(text: str, num_choices: int, extraction: Sequence[str]) -> str | None:
    """The letter a response answers with: the first of `extraction`'s answer forms (as for math),
    then "the answer is (C)"; None when it names no valid letter."""
    answer = extract_answer(text, (*extraction, "answer_is"))
    match = _LETTER.match(answer) if answer is not None else None
    letter = match.group(1) if match else None
    return letter if letter is not None and letter in LETTERS[:num_choices] else None
