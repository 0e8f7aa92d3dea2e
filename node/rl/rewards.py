"""Rule-based rewards. Validators and the trainer recompute them; a worker's claim is never used.

Math: the last ``\\boxed{...}`` after the thinking section (text after the last
``</think>``; an unclosed ``<think>`` scores 0) is compared with the reference,
first exactly as numbers (int, decimal, fraction), then symbolically with
math-verify (sympy underneath). Output is untrusted: the boxed text is capped in
length, and expressions that make sympy compute enormous numbers (power towers,
huge exponents or factorials) score 0 before sympy sees them, because
math-verify's own timeout relies on SIGALRM and only works on the main thread.

Code: see sandbox.py. Length: see length.py.
"""

from __future__ import annotations

import dataclasses
import re
import threading
from fractions import Fraction
from typing import Any

from .length import INTELLECT2_LENGTH_COEF, completion_length, length_penalty, target_length_reward
from .tasks import Problem

MAX_BOXED_CHARS = 256
MATH_TIMEOUT_S = 3


def answer_section(text: str) -> str | None:
    """The part after the thinking section: after the last ``</think>``; None if a ``<think>`` is never closed."""
    close = text.rfind("</think>")
    if close >= 0:
        return text[close + len("</think>"):]
    if "<think>" in text:
        return None
    return text


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) with balanced braces, else None."""
    best = None
    for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
            i += 1
        if depth == 0:
            best = text[m.end(): i - 1]
    return best


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


_NUM = re.compile(r"^[-+]?(\d+(\.\d*)?|\.\d+)$")
_FRAC = re.compile(r"^([-+]?)\\[dt]?frac\{([-+]?\d+)\}\{([-+]?\d+)\}$")
_SLASH = re.compile(r"^([-+]?\d+)\s*/\s*([-+]?\d+)$")


def _as_number(s: str) -> Fraction | None:
    s = s.strip().replace(" ", "").replace("{,}", "").replace("\\!", "").strip("$")
    if s.startswith("\\text{") and s.endswith("}"):
        s = s[6:-1]
    if len(s) > 200:
        return None
    if _NUM.match(s):
        return Fraction(s)
    if (m := _FRAC.match(s)) and int(m.group(3)) != 0:
        v = Fraction(int(m.group(2)), int(m.group(3)))
        return -v if m.group(1) == "-" else v
    if (m := _SLASH.match(s)) and int(m.group(2)) != 0:
        return Fraction(int(m.group(1)), int(m.group(2)))
    return None


_BIGNUM = re.compile(r"\d{7,}")


def _exponents(expr: str) -> list[tuple[str, int]]:
    """(exponent text, end index) for every ``^``/``**``, braces matched (nesting allowed)."""
    out = []
    i = 0
    while i < len(expr):
        if expr[i] == "^" or expr.startswith("**", i):
            j = i + (1 if expr[i] == "^" else 2)
            while j < len(expr) and expr[j] == " ":
                j += 1
            if j < len(expr) and expr[j] in "{(":
                open_c, close_c = expr[j], "}" if expr[j] == "{" else ")"
                depth, k = 0, j
                while k < len(expr):
                    depth += expr[k] == open_c
                    depth -= expr[k] == close_c
                    k += 1
                    if depth == 0:
                        break
                out.append((expr[j + 1 : k - 1], k))
                i = k
                continue
            m = re.match(r"[-+]?(\d+(\.\d*)?|\\?[a-zA-Z]+)", expr[j:])
            k = j + (m.end() if m else 0)
            out.append((expr[j:k], k))
            i = k
            continue
        i += 1
    return out


def looks_dangerous(expr: str) -> bool:
    """True for inputs that could make sympy compute for a very long time: power towers,
    exponents or factorials of large numbers, very long text."""
    if len(expr) > MAX_BOXED_CHARS:
        return True
    if expr.count("^") + expr.count("**") > 4:
        return True
    for exp, end in _exponents(expr):
        if "^" in exp or "**" in exp or "!" in exp:
            return True
        rest = expr[end:].lstrip()
        if rest.startswith("^") or rest.startswith("**"):  # chained a^b^c
            return True
        size = 1
        for d in re.findall(r"\d+", exp):
            size *= max(1, int(d))
            if size > 10_000:
                return True
    for m in re.finditer(r"(\d+)\s*\)?\s*!", expr):
        if int(m.group(1)) > 1000:
            return True
    if "!" in expr and _BIGNUM.search(expr):
        return True
    return False


def _symbolic_equal(pred: str, gold: str) -> bool:
    from math_verify import parse, verify

    main = threading.current_thread() is threading.main_thread()
    timeout = MATH_TIMEOUT_S if main else None
    try:
        g = parse(f"${gold}$", parsing_timeout=timeout)
        p = parse(f"${pred}$", parsing_timeout=timeout)
        if not g or not p:
            return False
        return bool(verify(g, p, timeout_seconds=timeout))
    except Exception:  # noqa: BLE001 - any failure to verify is a wrong answer
        return False


def math_reward(completion: str, answer: str) -> float:
    """1.0 if the final boxed answer equals ``answer`` (numerically or symbolically), else 0.0."""
    pred = extract_answer(completion)
    if pred is None or looks_dangerous(pred):
        return 0.0
    gold = str(answer).strip()
    a, b = _as_number(pred), _as_number(gold)
    if a is not None and b is not None:
        return 1.0 if a == b else 0.0
    if pred.replace(" ", "") == gold.replace(" ", ""):
        return 1.0
    if looks_dangerous(gold):
        return 0.0
    return 1.0 if _symbolic_equal(pred, gold) else 0.0


@dataclasses.dataclass
class RewardResult:
    """``reward`` is what GRPO uses; ``task_reward`` before the length term; ``passed`` feeds pass rates."""

    reward: float
    task_reward: float
    length_penalty: float
    passed: bool
    details: dict[str, Any] = dataclasses.field(default_factory=dict)


def compute_reward(
    problem: Problem,
    completion_text: str,
    completion_tokens: list[int] | None = None,
    *,
    eos_token_id: int | None = None,
    num_tokens: int | None = None,
    length_coef: float = INTELLECT2_LENGTH_COEF,
    code_timeout_s: float = 5.0,
) -> RewardResult:
    """The reward of one completion, from the problem's rules alone.

    ``num_tokens`` (or ``completion_tokens`` minus a final EOS) is the length used for
    length rewards. A math/code problem with ``target_length`` gets the INTELLECT-2
    penalty ``length_coef * |T - n|`` subtracted.
    """
    if num_tokens is None:
        num_tokens = completion_length(list(completion_tokens or []), eos_token_id)
    if problem.task == "length":
        assert problem.target_length is not None
        r = target_length_reward(num_tokens, problem.target_length)
        return RewardResult(r, r, 0.0, num_tokens == problem.target_length, {"length": num_tokens})
    if problem.task == "math":
        assert problem.answer is not None
        task_r = math_reward(completion_text, problem.answer)
        details: dict[str, Any] = {"extracted": extract_answer(completion_text)}
    elif problem.task == "code":
        from .sandbox import code_reward_detailed

        assert problem.tests is not None
        res = code_reward_detailed(completion_text, problem.tests, timeout_s=code_timeout_s)
        task_r = 1.0 if res.passed else 0.0
        details = {"status": res.status, "isolation": res.isolation}
    else:  # pragma: no cover - Problem validates task
        raise ValueError(problem.task)
    pen = length_penalty(num_tokens, problem.target_length, length_coef) if problem.target_length else 0.0
    return RewardResult(task_r - pen, task_r, pen, task_r >= 1.0, details)
