"""Dependency direction: protocol/ is pure (no torch, no node, no libp2p); proofs/ never imports node/."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def imported_modules(package: str) -> set[str]:
    names = set()
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names


def test_protocol_imports_no_torch_node_or_io_stack():
    bad = imported_modules("protocol") & {"torch", "node", "proofs", "libp2p", "trio", "socket", "numpy"}
    assert not bad


def test_proofs_imports_no_node():
    assert "node" not in imported_modules("proofs")


def test_importing_protocol_loads_no_torch():
    code = "import sys, protocol; print('torch' in sys.modules, 'node' in sys.modules, 'libp2p' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False", "False"]
