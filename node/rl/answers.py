"""Where a completion's answer is: the text after the thinking section, and the last
``\\boxed{...}`` in it. Pure text, shared by the rewards (what a worker's completion answered)
and the dataset loaders (a MATH-style solution's final answer), so neither imports the other.
"""

from __future__ import annotations

import re


def answer_section(text: str) -> str | None:
    """The part after the thinking section: after the last ``</think>``; None if a ``<think>`` is never closed."""
    close = text.rfind("</think>")
    if close >= 0:
        return text[close + len("</think>") :]
    if "<think>" in text:
        return None
    return text


_BOX_OPEN = re.compile(r"\\(?:boxed|fbox)\s*\{")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) with balanced braces, else None.

    One pass with a stack of open braces (linear in the text: output is untrusted, and scanning
    from every ``\\boxed{`` to its closing brace was quadratic on ``\\boxed{\\boxed{...``).
    A box's content ends at the first ``}`` that balances its ``{``; "last" means the box that
    starts last among those that close.
    """
    opens = {m.end() - 1: m.end() for m in _BOX_OPEN.finditer(text)}  # index of its "{" -> content start
    if not opens:
        return None
    stack: list[int] = []  # content start for a box's brace, -1 for any other "{"
    best_start, best_end = -1, -1
    for i, c in enumerate(text):
        if c == "{":
            stack.append(opens.get(i, -1))
        elif c == "}" and stack:
            start = stack.pop()
            if start > best_start:
                best_start, best_end = start, i
    return text[best_start:best_end] if best_start >= 0 else None


def extract_answer(completion: str) -> str | None:
    """The final boxed answer after the thinking section, stripped; None when there is none."""
    section = answer_section(completion)
    if section is None:
        return None
    boxed = last_boxed(section)
    if boxed is None:
        return None
    boxed = boxed.strip()
    return boxed or None
