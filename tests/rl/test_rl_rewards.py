"""Math and length rewards: correct, wrong, malformed and adversarial outputs."""

from __future__ import annotations

import threading

import pytest

from node.rl.answers import extract_answer, last_boxed
from node.rl.length import completion_length, length_penalty, target_length_reward
from node.rl.math_reward import math_reward
from node.rl.rewards import compute_reward
from node.rl.tasks import Problem


@pytest.mark.parametrize(
    "completion, answer",
    [
        ("<think>2+2 is 4</think> The answer is \\boxed{4}.", "4"),
        ("so \\boxed{0.5}", "\\frac{1}{2}"),
        ("\\boxed{\\frac{1}{2}}", "0.5"),
        ("\\boxed{1/2}", "\\frac12"),
        ("first \\boxed{3}, no wait: \\boxed{-7}", "-7"),
        ("\\boxed{x^2 + 2x + 1}", "(x+1)^2"),
        ("\\boxed{\\sqrt{8}}", "2\\sqrt{2}"),
        ("\\boxed{ 1,000 }".replace(",", "{,}"), "1000"),
        ("<think>\\boxed{1}</think>\\boxed{{12}}", "12"),
    ],
)
def test_math_correct(completion, answer):
    assert math_reward(completion, answer) == 1.0


@pytest.mark.parametrize(
    "completion, answer",
    [
        ("\\boxed{5}", "4"),
        ("\\boxed{3} then finally \\boxed{5}", "3"),  # only the last box counts
        ("\\boxed{x^2 + 1}", "(x+1)^2"),
        ("\\boxed{0.33}", "\\frac{1}{3}"),
    ],
)
def test_math_wrong(completion, answer):
    assert math_reward(completion, answer) == 0.0


@pytest.mark.parametrize(
    "completion",
    [
        "",
        "The answer is 4.",  # no box
        "\\boxed{4",  # unbalanced
        "\\boxed{}",  # empty box (a reward hack seen with SmolLM2)
        "<think>I think \\boxed{4}",  # thinking never closed: the box is inside it
        "<think>\\boxed{4}</think> no answer after thinking",
        "\\boxed{\\frac{4}{}}",
        "\\boxed{\x00\x01\xff}",
        "}" * 1000 + "\\boxed{" + "{" * 5000,
    ],
)
def test_math_malformed_scores_zero(completion):
    assert math_reward(completion, "4") == 0.0


def reward_in_worker_thread(completion: str, answer: str, guard_s: float = 300.0) -> float:
    """math_reward computed the way roles compute it: in a worker thread, where math-verify's SIGALRM
    timeout does not exist. The join bound only stops a hang from stalling the suite."""
    out: list[float] = []
    th = threading.Thread(target=lambda: out.append(math_reward(completion, answer)), daemon=True)
    th.start()
    th.join(guard_s)
    assert not th.is_alive(), "math_reward hung"
    return out[0]


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("\\boxed{9^{9^{9^{9}}}}", 0.0),  # power tower: sympy would never finish
        ("\\boxed{9^9^9}", 0.0),  # the same unbraced
        ("\\boxed{2^{100000000}}", 0.0),  # a 30-million-digit integer
        ("\\boxed{100000000!}", 0.0),
        ("\\boxed{(x+1)^{9999}}", 0.0),  # passes the cheap guards; sympy expands it for minutes
        ("\\boxed{(x+y+z)^{9999}}", 0.0),
        ("\\boxed{" + "1+" * 5000 + "1}", 0.0),  # huge expression (and not 4)
        ("\\boxed{" + "2+" * 101 + "-198}", 1.0),  # 4 as a sum of 206 characters: checked
        ("\\boxed{" + "1+" * 200 + "-196}", 0.0),  # 4 as a sum of 404 characters: over the 256 cap, not parsed
        ("\\boxed{2^{2}}", 1.0),  # a small power is still checked symbolically
        ("\\boxed{4" + " " * 10_000 + "}", 1.0),  # padding around the right answer
        ("\\boxed{\\boxed{\\boxed{" * 50 + "4" + "}}}" * 50, 1.0),  # nested boxes: the innermost is last
        ("\\boxed{4}" * 20_000, 1.0),  # long output
        ("\\boxed{9^{9^{9}}} no, finally \\boxed{4}", 1.0),  # a dangerous earlier box is ignored
        ("\\boxed{4} then \\boxed{9^{9^{9}}}", 0.0),  # the last box is the answer, even a dangerous one
        ("\\boxed{" * 50_000 + "4", 0.0),  # nothing closes (was quadratic: minutes)
        ("\\boxed{4}" + "\\boxed{" * 50_000, 1.0),  # the only closed box is the answer
        ("<think>" + "\\boxed{" * 20_000 + "</think>\\boxed{4}", 1.0),
    ],
)
def test_math_adversarial(completion, expected):
    assert reward_in_worker_thread(completion, "4") == expected


def test_symbolic_check_overrun_kills_the_helper(monkeypatch):
    """The helper's deadline is the backstop for whatever the guards and math-verify's timeout miss."""
    import node.rl.math_reward as rw

    monkeypatch.setattr(rw, "MATH_TIMEOUT_S", 600)  # math-verify's own timeout would not fire
    monkeypatch.setattr(rw, "SYMBOLIC_DEADLINE_S", 1.0)
    assert math_reward("\\boxed{x^2+2x+1}", "(x+1)^2") == 1.0  # a helper is up
    helper = rw._idle_helpers[-1]
    assert reward_in_worker_thread("\\boxed{(x+1)^{9999}}", "4") == 0.0
    assert not helper.alive() and helper not in rw._idle_helpers  # killed, not reused
    monkeypatch.setattr(rw, "SYMBOLIC_DEADLINE_S", 60.0)
    assert reward_in_worker_thread("\\boxed{x^2+2x+1}", "(x+1)^2") == 1.0  # a fresh helper answers


def test_extraction():
    assert last_boxed("a \\boxed{\\frac{1}{2}} b \\boxed{x_{1}}") == "x_{1}"
    assert extract_answer("<think>\\boxed{1}</think>\\boxed{2}") == "2"
    assert extract_answer("<think>\\boxed{1}") is None


def test_length_terms():
    assert length_penalty(100, 120) == pytest.approx(0.006)
    assert length_penalty(120, 100) == pytest.approx(0.006)
    assert target_length_reward(16, 16) == 1.0 and target_length_reward(8, 16) == 0.5
    assert target_length_reward(48, 8) == -4.0
    assert completion_length([5, 6, 2], eos_token_id=2) == 2 and completion_length([5, 6], 2) == 2


def test_compute_reward_combines_task_and_length():
    p = Problem(id="m", prompt="Think for 10 tokens. 2+2?", task="math", answer="4", target_length=10)
    r = compute_reward(p, "\\boxed{4}", num_tokens=110)
    assert r.task_reward == 1.0 and r.passed and r.reward == pytest.approx(1.0 - 0.03)
    r = compute_reward(p, "\\boxed{5}", num_tokens=10)
    assert r.reward == 0.0 and not r.passed
    lp = Problem(id="l", prompt="len 8:", task="length", target_length=8)
    r = compute_reward(lp, "", completion_tokens=[9] * 8 + [2], eos_token_id=2)
    assert r.reward == 1.0 and r.passed
    cp = Problem(id="c", prompt="write f", task="code", tests="assert f(2) == 4")
    assert compute_reward(cp, "```python\ndef f(x):\n    return x * 2\n```", num_tokens=5).reward == 1.0
    assert compute_reward(cp, "```python\ndef f(x):\n    return x + 3\n```", num_tokens=5).reward == 0.0
