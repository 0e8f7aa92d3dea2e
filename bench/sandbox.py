"""Code-reward sandbox throughput and latency (issue 15): programs scored per second, before/after.

    python bench/sandbox.py [--programs 60] [--workers 2]

"before": each program plus its asserts run in a plain ``python -I -S`` subprocess (the flags the sandbox uses) with no isolation
(what the old in-process guard cost at best: one interpreter per program, verdict = exit code), waited for
without a timeout (``Popen.wait(timeout)`` polls with sleeps of up to 50 ms, which would inflate the baseline).
"after": ``node.rl.sandbox.run_python_tests`` (bubblewrap + seccomp + limits, verdict outside).
Both score the same mix (correct and wrong ``add``; legacy asserts, call and io specs), every program once
serially for latency (p50, p95) and with ``--workers`` threads for throughput. Prints a table, the load
average (the machine may be shared) and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from node.rl.sandbox import require_sandbox, run_python_tests, sandbox_python

ADD = "def add(a, b):\n    return a + b\n"
WRONG = "def add(a, b):\n    return a - b\n"
ASSERTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\nassert add(10, 5) == 15\n"
CALLS = json.dumps({"calls": [{"call": "add(2, 3)", "expect": 5}, {"call": "add(-1, 1)", "expect": 0}]})
IO_CODE = "a, b = map(int, input().split())\nprint(a + b)\n"
IO = json.dumps({"io": [{"stdin": "2 3\n", "stdout": "5\n"}]})
MIX = [(ADD, ASSERTS, True), (WRONG, ASSERTS, False), (ADD, CALLS, True), (IO_CODE, IO, True)]


def plain(code: str, tests: str, python: str) -> bool:
    """Baseline: no isolation, the program and its asserts in one unconfined interpreter."""
    with tempfile.TemporaryDirectory() as d:
        if tests.startswith("{"):
            spec = json.loads(tests)
            if "io" in spec:
                Path(d, "s.py").write_text(code)
                for case in spec["io"]:
                    r = subprocess.run(
                        [python, "-I", "-S", "s.py"], cwd=d, input=case["stdin"], capture_output=True, text=True
                    )
                    if r.stdout.strip() != case["stdout"].strip():
                        return False
                return True
            tests = "".join(f"assert ({c['call']}) == {c['expect']!r}\n" for c in spec["calls"])
        r = subprocess.run([python, "-I", "-S", "-c", code + tests], cwd=d, capture_output=True)
        return r.returncode == 0


def sandboxed(code: str, tests: str, _python: str) -> bool:
    return run_python_tests(code, tests, timeout_s=10).passed


def measure(fn, n: int, workers: int, python: str) -> dict[str, float]:
    jobs = [MIX[i % len(MIX)] for i in range(n)]
    lat = []
    for code, tests, want in jobs:  # serial: latency per program
        t = time.perf_counter()
        assert fn(code, tests, python) == want, (code, tests)
        lat.append(time.perf_counter() - t)
    t = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        got = list(pool.map(lambda j: fn(j[0], j[1], python), jobs))
    wall = time.perf_counter() - t
    assert got == [w for _, _, w in jobs]
    return {
        "p50_ms": statistics.median(lat) * 1000,
        "p95_ms": statistics.quantiles(lat, n=20)[18] * 1000,
        "mean_ms": statistics.fmean(lat) * 1000,
        "per_s": n / wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--programs", type=int, default=60)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    info = require_sandbox()
    python = sandbox_python()[0]  # the same interpreter on both sides
    load_start = os.getloadavg()[0]
    before = measure(plain, args.programs, args.workers, python)
    after = measure(sandboxed, args.programs, args.workers, python)
    load = (load_start, os.getloadavg()[0])
    overhead = after["p50_ms"] - before["p50_ms"]
    print(f"code sandbox bench: {args.programs} programs, {args.workers} workers, {os.cpu_count()} CPUs, {python}")
    print(f"sandbox: {info['isolation']} ({info['version']})")
    print(f"load average (1 min) at start/end: {load[0]:.2f} / {load[1]:.2f}")
    print(f"{'':28}{'p50 ms':>10}{'p95 ms':>10}{'mean ms':>10}{'programs/s':>12}")
    for name, m in (("before: plain python -I -S", before), ("after: bwrap+seccomp", after)):
        print(f"{name:28}{m['p50_ms']:10.1f}{m['p95_ms']:10.1f}{m['mean_ms']:10.1f}{m['per_s']:12.1f}")
    print(f"added latency per program (p50): {overhead:.1f} ms (goal < 50 ms)")
    print(
        json.dumps(
            {
                "bench": "sandbox",
                "programs": args.programs,
                "workers": args.workers,
                "loadavg": load,
                "before": before,
                "after": after,
                "overhead_p50_ms": overhead,
                "goal_met": overhead < 50,
            }
        )
    )


if __name__ == "__main__":
    main()
