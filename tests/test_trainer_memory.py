"""The trainer's process returns freed blocks to the OS (glibc's fixed mmap threshold)."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Blocks of 2 MiB like a step's activations: one freed first (glibc then raises its sliding
# threshold to 2 MiB), then 120 live at once, each followed by a small block that stays
# allocated (a metric, a saved scalar), then the 120 freed. Prints the resident MiB the frees gave back.
CHILD = """
import json, sys
import torch
from node.rl.grpo import set_malloc_mmap_threshold

def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20

applied = set_malloc_mmap_threshold(1 << 20) if sys.argv[1] == "fixed" else None
n = (2 << 20) // 4
first = torch.ones(n)
del first
blocks, pins = [], []
for _ in range(120):
    blocks.append(torch.ones(n))
    pins.append(torch.ones(4096))
held = rss_mib()
del blocks
print(json.dumps({"applied": applied, "returned_mib": held - rss_mib()}))
"""


def returned_mib(mode: str) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, mode], cwd=ROOT, capture_output=True, text=True, check=True, timeout=120
    )
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the threshold is a glibc knob")
def test_freed_step_blocks_go_back_to_the_os_under_the_trainers_threshold():
    sliding = returned_mib("sliding")  # glibc's default: the freed blocks stay in its heap
    assert sliding["returned_mib"] < 40
    fixed = returned_mib("fixed")
    assert fixed["applied"] is True
    assert fixed["returned_mib"] > 200  # 240 MiB were freed
