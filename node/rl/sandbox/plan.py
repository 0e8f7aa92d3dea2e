"""The test formats of a code problem and the verdict on a sandboxed run's values (pure: no I/O).

:func:`parse_tests` splits a problem's tests into what goes into the sandbox (the steps to run)
and what stays out (the expected values); :func:`parse_results` reads the values the child sent
back (nothing else it wrote counts) and :func:`judge` compares them here, outside the sandbox.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import math
import re
from typing import Any

_FENCE = re.compile(r"```[ \t]*(python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_last_python_block(text: str) -> str | None:
    """The last fenced code block tagged python (or untagged when no tagged one exists)."""
    tagged, untagged = None, None
    for m in _FENCE.finditer(text):
        if m.group(1):
            tagged = m.group(2)
        else:
            untagged = m.group(2)
    return tagged if tagged is not None else untagged


# --------------------------------------------------------------------------- test formats

_MISSING = object()
_OPS = {
    ast.Eq: "==",
    ast.NotEq: "!=",
    ast.Lt: "<",
    ast.LtE: "<=",
    ast.Gt: ">",
    ast.GtE: ">=",
    ast.In: "in",
    ast.NotIn: "not in",
    ast.Is: "is",
    ast.IsNot: "is not",
}


@dataclasses.dataclass
class TestPlan:
    """What goes into the sandbox (``mode``, ``steps``) and what stays out (``checks``).

    ``mode == "io"``: ``steps`` are ``{"stdin": str}``; the program runs once per step and
    check ``("stdout", i, expected)`` compares its standard output.
    ``mode == "calls"``: ``steps`` are ``{"exec": src}`` (setup, run inside) or ``{"eval": src}``
    (an expression whose value comes back serialised); checks compare those values here.
    """

    mode: str
    steps: list[dict[str, Any]]
    checks: list[tuple[Any, ...]]
    weak: int = 0


def _literal(node: ast.expr) -> Any:
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return _MISSING


def _legacy_plan(tests: str) -> TestPlan:
    """Python ``assert`` statements. Each top-level assert's operands are evaluated inside and
    compared here; a literal operand never enters the sandbox. Other statements run inside."""
    tree = ast.parse(tests)
    steps: list[dict[str, Any]] = []
    checks: list[tuple[Any, ...]] = []
    weak = 0

    def operand(node: ast.expr) -> tuple[str, Any]:
        lit = _literal(node)
        if lit is not _MISSING:
            return ("lit", lit)
        steps.append({"eval": ast.unparse(node)})
        return ("val", len(steps) - 1)

    for stmt in tree.body:
        if isinstance(stmt, ast.Assert):
            t = stmt.test
            if isinstance(t, ast.Compare) and all(type(op) in _OPS for op in t.ops):
                sides = [operand(t.left)] + [operand(c) for c in t.comparators]
                ops = [_OPS[type(op)] for op in t.ops]
                checks.append(("cmp", ops, sides))
                strong = ops == ["=="] and sorted(s[0] for s in sides) == ["lit", "val"]
                weak += not strong
            elif isinstance(t, ast.UnaryOp) and isinstance(t.op, ast.Not):
                checks.append(("falsy", operand(t.operand)))
                weak += 1
            else:
                checks.append(("truthy", operand(t)))
                weak += 1
        else:
            steps.append({"exec": ast.unparse(stmt)})
            weak += sum(isinstance(n, ast.Assert) for n in ast.walk(stmt))  # asserts judged inside
    if not checks:  # statements only: passing means running to the end, which the program can forge
        weak = max(weak, 1)
    return TestPlan("calls", steps, checks, weak)


def parse_tests(tests: str) -> TestPlan:
    """Turn a problem's ``tests`` (see docs/rl.md, "Code test formats") into a plan.

    * ``{"io": [{"stdin": "...", "stdout": "..."}, ...]}`` (or INTELLECT-2's list of
      ``{"input": ..., "output": ...}``): the program reads stdin; its stdout is compared here
      (trailing whitespace of each line and trailing blank lines ignored). Strong: the
      expected output never enters the sandbox.
    * ``{"calls": [{"call": "f(1, 2)", "expect": <json>, "tol": 1e-9?}, ...], "setup": "src"?}``:
      each expression's value is serialised as plain data (exact builtin types only: an object
      with an overridden ``__eq__`` is not data) and compared here with ``expect``. Strong.
    * Python source with ``assert`` statements (the legacy format): ``assert EXPR == LITERAL``
      is as strong as a call (the literal stays outside); other top-level asserts (truthiness,
      ``!=``, ``<``, two computed sides) are judged here on serialised values but are *weak*:
      a program that tampers with the harness can guess the outcome they want; asserts inside
      loops or functions are judged inside the sandbox, and are weak too.
    """
    text = tests.strip()
    if text[:1] in "[{":
        try:
            spec = json.loads(text)
        except ValueError:
            spec = None
        if isinstance(spec, list) and spec and all(isinstance(c, dict) for c in spec):
            spec = {"io": spec}
        if isinstance(spec, dict) and ("io" in spec or "calls" in spec):
            return _json_plan(spec)
    return _legacy_plan(tests)


def _json_plan(spec: dict[str, Any]) -> TestPlan:
    steps: list[dict[str, Any]] = []
    checks: list[tuple[Any, ...]] = []
    if "io" in spec:
        for i, case in enumerate(spec["io"]):
            stdin = case.get("stdin", case.get("input", ""))
            stdout = case.get("stdout", case.get("output"))
            if not isinstance(stdin, str) or not isinstance(stdout, str):
                raise ValueError(f"io case {i} needs string stdin/input and stdout/output")
            steps.append({"stdin": stdin})
            checks.append(("stdout", i, stdout))
        if not steps:
            raise ValueError("no io cases")
        return TestPlan("io", steps, checks)
    if spec.get("setup"):
        steps.append({"exec": str(spec["setup"])})
    for i, case in enumerate(spec["calls"]):
        if not isinstance(case, dict) or not isinstance(case.get("call"), str) or "expect" not in case:
            raise ValueError(f"call case {i} needs 'call' (an expression) and 'expect'")
        compile(case["call"], f"<call {i}>", "eval")
        steps.append({"eval": case["call"]})
        checks.append(("json", len(steps) - 1, case["expect"], float(case.get("tol", 0.0))))
    if not checks:
        raise ValueError("no call cases")
    return TestPlan("calls", steps, checks)


def _decode(v: Any) -> Any:
    """The harness's tagged encoding back to genuine builtin values (built here, never inside)."""
    if isinstance(v, list):
        return [_decode(x) for x in v]
    if isinstance(v, dict):
        if len(v) != 1:
            raise ValueError("bad tagged value")
        ((tag, body),) = v.items()
        if tag == "tuple":
            return tuple(_decode(x) for x in body)
        if tag == "set":
            return {_decode(x) for x in body}
        if tag == "frozenset":
            return frozenset(_decode(x) for x in body)
        if tag == "dict":
            return {_decode(k): _decode(x) for k, x in body}
        if tag == "bytes":
            return bytes.fromhex(body)
        if tag == "float":
            return float(body)
        raise ValueError(f"unknown tag {tag!r}")
    if v is None or type(v) in (bool, int, float, str):
        return v
    raise ValueError("bad value")


def _json_like(v: Any) -> Any:
    if isinstance(v, (list, tuple)):
        return [_json_like(x) for x in v]
    if isinstance(v, dict):
        if not all(isinstance(k, str) for k in v):
            raise ValueError("non-string key")
        return {k: _json_like(x) for k, x in v.items()}
    if isinstance(v, (set, frozenset, bytes)):
        raise ValueError("not JSON data")
    return v


def _json_equal(got: Any, want: Any, tol: float) -> bool:
    """Strict JSON equality: bool is not int, numbers compare by value (``tol``: relative/absolute)."""
    if isinstance(want, bool) or isinstance(got, bool):
        return type(got) is type(want) and got == want
    if isinstance(want, (int, float)) and isinstance(got, (int, float)):
        if tol:
            return math.isclose(got, want, rel_tol=tol, abs_tol=tol)
        return got == want
    if isinstance(want, list) and isinstance(got, list):
        return len(got) == len(want) and all(_json_equal(g, w, tol) for g, w in zip(got, want, strict=True))
    if isinstance(want, dict) and isinstance(got, dict):
        return got.keys() == want.keys() and all(_json_equal(got[k], want[k], tol) for k in want)
    return type(got) is type(want) and got == want


def _compare(op: str, a: Any, b: Any) -> bool:
    if op == "==":
        return bool(a == b)
    if op == "!=":
        return bool(a != b)
    if op == "<":
        return bool(a < b)
    if op == "<=":
        return bool(a <= b)
    if op == ">":
        return bool(a > b)
    if op == ">=":
        return bool(a >= b)
    if op == "in":
        return a in b
    if op == "not in":
        return a not in b
    if op == "is":
        return a is b if a is None or b is None or isinstance(a, bool) or isinstance(b, bool) else a == b
    if op == "is not":
        return not _compare("is", a, b)
    raise ValueError(op)


def _normalise_stdout(s: str) -> str:
    return "\n".join(line.rstrip() for line in s.rstrip().splitlines())


def judge(plan: TestPlan, values: dict[int, Any]) -> tuple[bool, str]:
    """Every check against the values the sandbox returned; (passed, why not)."""
    for n, check in enumerate(plan.checks):
        try:
            kind = check[0]
            if kind == "stdout":
                _, i, want = check
                if i not in values:
                    return False, f"case {i}: no output"
                if _normalise_stdout(values[i]) != _normalise_stdout(want):
                    return False, f"case {i}: wrong output"
                continue
            if kind == "json":
                _, i, want, tol = check
                if i not in values or not _json_equal(_json_like(values[i]), want, tol):
                    return False, f"check {n}: wrong value"
                continue

            def side(s: tuple[str, Any]) -> Any:
                if s[0] == "lit":
                    return s[1]
                if s[1] not in values:
                    raise KeyError(s[1])
                return values[s[1]]

            if kind == "truthy" or kind == "falsy":
                if bool(side(check[1])) != (kind == "truthy"):
                    return False, f"check {n}: assert failed"
                continue
            _, ops, sides = check
            vals = [side(s) for s in sides]
            for op, a, b in zip(ops, vals, vals[1:]):  # a chained comparison
                if not _compare(op, a, b):
                    return False, f"check {n}: assert failed"
        except KeyError:
            return False, f"check {n}: no value (the program stopped before it)"
        except Exception as exc:  # a comparison of genuine builtin values that raises (e.g. 1 < "a")
            return False, f"check {n}: {type(exc).__name__}"
    return True, ""


def parse_results(raw: bytes, plan: TestPlan) -> tuple[dict[int, Any] | None, str]:
    """The harness's lines -> {step index: value}; None (and why) when they are not a clean record.
    The program can write here too, but only values count, and it never sees the expected ones."""
    values: dict[int, Any] = {}
    started = done = False
    for line in raw.splitlines():
        try:
            obj = json.loads(line)
            if not isinstance(obj, dict):
                return None, "malformed result record"
            if obj.get("started") is True and not started:
                started = True
            elif obj.get("done") is True:
                done = True
            elif "error" in obj:
                where = f"step {obj['i']}" if "i" in obj else "solution"
                return None, f"{where}: {str(obj['error'])[:200]}"
            elif isinstance(obj.get("i"), int) and "v" in obj:
                i = obj["i"]
                if i in values or not 0 <= i < len(plan.steps):
                    return None, "duplicate or unknown result"
                values[i] = obj["v"] if plan.mode == "io" else _decode(obj["v"])
                if plan.mode == "io" and not isinstance(values[i], str):
                    return None, "malformed result record"
            else:
                return None, "malformed result record"
        except (ValueError, TypeError, KeyError, RecursionError) as exc:
            return None, f"malformed result record ({type(exc).__name__})"
    if not started:
        return None, "the harness did not start"
    if not done:
        return None, "the program ended before its tests did"
    return values, ""
