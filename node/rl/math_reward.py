"""The math reward: the last ``\\boxed{...}`` after the thinking section (text after the
last ``</think>``; an unclosed ``<think>`` scores 0) is compared with the reference, first
exactly as numbers (int, decimal, fraction), then symbolically with math-verify (sympy
underneath).

Output is untrusted: extraction is linear in the text, the boxed text is capped in length,
and expressions that make sympy compute enormous numbers (power towers, huge exponents or
factorials) score 0 before sympy sees them. What remains goes to math-verify in a helper
process (:mod:`node.rl.math_child`) with a hard deadline (math-verify's own timeout is a
SIGALRM, which only works on a main thread, and roles compute rewards in worker threads); an
overrun scores 0 and the helper is killed.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import select
import signal
import subprocess
import sys
import threading
from fractions import Fraction
from pathlib import Path

from node.rl.answers import extract_answer

MAX_BOXED_CHARS = 256
MATH_TIMEOUT_S = 3


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
    return bool("!" in expr and _BIGNUM.search(expr))


# The symbolic check runs in a helper process: math-verify's own timeout is a SIGALRM, which only
# exists on a main thread, and roles compute rewards in worker threads; a thread running sympy
# cannot be stopped (``(x+1)^{9999}`` ran for minutes). In the helper, math-verify runs on its main
# thread with its timeouts on, under an address-space limit; the caller also waits at most
# SYMBOLIC_DEADLINE_S and SIGKILLs a helper that overruns (native code ignores SIGALRM). Helpers are
# reused (one per concurrent caller, at most MAX_SYMBOLIC_HELPERS) and restarted after a kill.
SYMBOLIC_DEADLINE_S = 3 * MATH_TIMEOUT_S + 2.0  # parse gold, parse pred, verify, then some slack
SYMBOLIC_HELPER_MEMORY = 2 * 1024**3
SYMBOLIC_HELPER_START_S = 120.0  # interpreter + sympy import, on a busy 2-core machine
MAX_SYMBOLIC_HELPERS = 4


class SymbolicHelper:
    """One helper process answering "is pred equal to gold?" a line at a time."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-I", str(Path(__file__).with_name("math_child.py")), str(SYMBOLIC_HELPER_MEMORY)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        if self._read_line(SYMBOLIC_HELPER_START_S) != b"ready":
            self.kill()
            raise RuntimeError("the symbolic math checker (math-verify in a helper process) did not start")

    def _read_line(self, timeout_s: float) -> bytes | None:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        if not ready:
            return None
        line = self.proc.stdout.readline()  # the helper writes whole short lines, flushed
        return line.strip() if line else None

    def equal(self, pred: str, gold: str) -> bool | None:
        """True/False, or None when the helper overran the deadline or died (it is then dead)."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps({"pred": pred, "gold": gold, "timeout": MATH_TIMEOUT_S}).encode() + b"\n")
            self.proc.stdin.flush()
        except OSError:
            self.kill()
            return None
        reply = self._read_line(SYMBOLIC_DEADLINE_S)
        if reply not in (b"0", b"1"):
            self.kill()
            return None
        return reply == b"1"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        for fh in (self.proc.stdin, self.proc.stdout):
            if fh is not None:
                try:
                    fh.close()
                except OSError:
                    pass


_idle_helpers: list[SymbolicHelper] = []
_helpers_lock = threading.Lock()
_helper_slots = threading.BoundedSemaphore(MAX_SYMBOLIC_HELPERS)


def _close_helpers() -> None:
    with _helpers_lock:
        while _idle_helpers:
            _idle_helpers.pop().kill()


atexit.register(_close_helpers)


def _symbolic_equal(pred: str, gold: str) -> bool:
    """math-verify's verdict, computed in a helper process with a hard deadline (False on overrun)."""
    with _helper_slots:
        with _helpers_lock:
            helper = _idle_helpers.pop() if _idle_helpers else None
        if helper is None or not helper.alive():
            helper = SymbolicHelper()
        verdict = helper.equal(pred, gold)
        if verdict is None:
            return False
        with _helpers_lock:
            _idle_helpers.append(helper)
        return verdict


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
