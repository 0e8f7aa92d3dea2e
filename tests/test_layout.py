"""The import graph, enforced: each package may import only the layers below it.

    protocol            pure wire formats and rules: nothing of ours, no I/O stack, no torch
    proofs              TOPLOC: at most protocol
    node base modules   util, errors, config, home, genesis_file, models, memory: protocol, proofs, each other
    node.p2p            networking: protocol and the base helpers (util, errors) only
    node.checkpoints    store + data plane: protocol and the base helpers (util, errors) only
    node.engines        inference: never networking, checkpoints, roles or ops
    node.rl             learning: never networking, checkpoints, roles or ops
    node.roles          anything but ops
    node.ops            the operator package (CLI, daemon, status, devnet): nothing imports it

Imports inside functions count too (a lazy import is still a dependency).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
OURS = ("protocol", "proofs", "node")

BASE = ("node.util", "node.errors", "node.config", "node.home", "node.genesis_file", "node.models", "node.memory")
HELPERS = ("node.util", "node.errors")

# layer -> the prefixes of our own modules it may import (its own package is always allowed)
ALLOWED: dict[str, tuple[str, ...]] = {
    "protocol": (),
    "proofs": ("protocol",),
    "node.base": ("protocol", "proofs", *BASE),
    "node.p2p": ("protocol", *HELPERS),
    "node.checkpoints": ("protocol", *HELPERS),
    "node.engines": ("protocol", "proofs", *BASE),
    "node.rl": ("protocol", "proofs", *BASE, "node.engines"),
    "node.roles": ("protocol", "proofs", *BASE, "node.p2p", "node.checkpoints", "node.engines", "node.rl"),
    "node.ops": ("protocol", "proofs", "node"),
}
THIRD_PARTY_BANNED = {
    "protocol": {"torch", "numpy", "libp2p", "trio", "socket", "safetensors", "transformers"},
    "proofs": {"libp2p", "trio", "socket"},
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> str:
    if module in BASE or module == "node":
        return "node.base"
    for layer in ALLOWED:
        if module == layer or module.startswith(layer + "."):
            return layer
    raise AssertionError(f"{module} belongs to no layer: add it to tests/test_layout.py")


def imports_of(path: Path) -> set[str]:
    """Absolute names of every module ``path`` imports (relative imports resolved)."""
    module = module_name(path)
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                names.add(".".join(base + ([node.module] if node.module else [])))
            elif node.module:
                names.add(node.module)
    return names


def allowed(layer: str, target: str) -> bool:
    own = layer if layer != "node.base" else None
    prefixes = ALLOWED[layer] + ((own,) if own else ())
    if layer == "node.base" and target in BASE:
        return True
    return any(target == p or target.startswith(p + ".") for p in prefixes)


def violations(files: list[Path]) -> list[str]:
    found = []
    for path in files:
        layer = layer_of(module_name(path))
        for target in sorted(imports_of(path)):
            top = target.split(".")[0]
            if top in THIRD_PARTY_BANNED.get(layer, ()):
                found.append(f"{module_name(path)} imports {target} ({layer} must not)")
            if top in OURS and not allowed(layer, target):
                found.append(f"{module_name(path)} imports {target} ({layer} may not)")
    return found


def our_files() -> list[Path]:
    return sorted(p for pkg in OURS for p in (ROOT / pkg).rglob("*.py"))


def test_every_module_has_a_layer():
    for path in our_files():
        layer_of(module_name(path))


def test_import_graph_follows_the_layers():
    assert violations(our_files()) == []


def test_nothing_outside_ops_imports_ops():
    offenders = [
        module_name(p)
        for p in our_files()
        if layer_of(module_name(p)) != "node.ops" and any(t.startswith("node.ops") for t in imports_of(p))
    ]
    assert offenders == []


@pytest.mark.parametrize(
    ("module", "source", "bad"),
    [
        ("protocol/x.py", "import node.util\n", True),
        ("protocol/x.py", "import torch\n", True),
        ("proofs/x.py", "from protocol import rules\n", False),
        ("proofs/x.py", "from node.errors import NodeError\n", True),
        ("node/p2p/x.py", "from node.util import now_ms\n", False),
        ("node/p2p/x.py", "from node.checkpoints import Checkpoints\n", True),
        ("node/checkpoints/x.py", "from node.p2p.node import Node\n", True),
        ("node/rl/x.py", "def f():\n    from node.roles.context import RunContext\n", True),
        ("node/engines/x.py", "from node.p2p import Node\n", True),
        ("node/roles/x.py", "from node.checkpoints import Checkpoints\n", False),
        ("node/roles/x.py", "from node.ops.cli import main\n", True),
        ("node/home.py", "from node.roles import context\n", True),
        ("node/checkpoints/x.py", "from ..roles import common\n", True),
    ],
)
def test_the_checker_catches_what_it_should(tmp_path, monkeypatch, module, source, bad):
    """A control for the checker itself: a planted import is flagged exactly when it breaks a rule."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    path = tmp_path / module
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source)
    assert bool(violations([path])) is bad


def test_importing_protocol_loads_no_torch():
    code = "import sys, protocol; print('torch' in sys.modules, 'node' in sys.modules, 'libp2p' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False", "False"]
