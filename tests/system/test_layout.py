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

libp2p is imported only in node.p2p: every other room sees the network through ``Node``.

Imports inside functions count too (a lazy import is still a dependency). And no two modules
import each other, directly or round a longer loop: a circle makes the import order matter and
says two rooms answer one question (the shared part belongs in a module of its own).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
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
    raise AssertionError(f"{module} belongs to no layer: add it to tests/system/test_layout.py")


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
            if top == "libp2p" and layer != "node.p2p":
                found.append(f"{module_name(path)} imports {target} (only node.p2p may import libp2p)")
            elif top in THIRD_PARTY_BANNED.get(layer, ()):
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


# Outside the shipped packages: what tests and benchmarks share lives in harness/, which both
# import; neither imports the other, and the shipped code imports none of the three.
SIDES = {"tests": ("bench",), "bench": ("tests",), "harness": ("tests", "bench")}
SHIPPED_NEVER = ("tests", "bench", "harness")


def harness_violations(files: list[Path]) -> list[str]:
    found = []
    for path in files:
        side = path.relative_to(ROOT).parts[0]
        banned = SIDES.get(side, SHIPPED_NEVER if side in OURS else ())
        for target in sorted(imports_of(path)):
            if target.split(".")[0] in banned:
                found.append(f"{path.relative_to(ROOT)} imports {target} ({side} may not)")
    return found


def test_tests_and_benchmarks_share_the_harness_and_never_import_each_other():
    files = our_files() + sorted(
        p for d in ("tests", "bench", "harness") for p in (ROOT / d).rglob("*.py") if "node_modules" not in p.parts
    )
    assert harness_violations(files) == []


@pytest.mark.parametrize(
    ("module", "source", "bad"),
    [
        ("tests/x/test_a.py", "from harness.netns import Testbed\n", False),
        ("tests/x/test_a.py", "from bench import hostile\n", True),
        ("bench/a.py", "from harness.wan import WanDevnet\n", False),
        ("bench/a.py", "def f():\n    from tests.x.test_a import helper\n", True),
        ("harness/a.py", "import bench.wan\n", True),
        ("harness/a.py", "from node.ops.devnet import Devnet\n", False),
        ("node/roles/a.py", "from harness import fuzz\n", True),
    ],
)
def test_the_harness_checker_catches_what_it_should(tmp_path, monkeypatch, module, source, bad):
    assert bool(harness_violations([planted(tmp_path, monkeypatch, module, source)])) is bad


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
        ("node/p2p/x.py", "from libp2p.peer.id import ID\n", False),
        ("node/roles/x.py", "def f():\n    from libp2p.peer.id import ID\n", True),
        ("node/ops/x.py", "import libp2p\n", True),
    ],
)
def test_the_checker_catches_what_it_should(tmp_path, monkeypatch, module, source, bad):
    """A control for the checker itself: a planted import is flagged exactly when it breaks a rule."""
    assert bool(violations([planted(tmp_path, monkeypatch, module, source)])) is bad


def planted(tmp_path: Path, monkeypatch, module: str, source: str) -> Path:
    """``source`` written as ``module`` of a repository rooted at ``tmp_path``."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    path = tmp_path / module
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source)
    return path


def module_targets(path: Path, modules: set[str]) -> set[str]:
    """Our modules ``path`` imports: ``from pkg import name`` counts as ``pkg.name`` when that is
    a module (a package's ``__init__`` is a facade, not the room the name lives in)."""
    module = module_name(path)
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            base = base if node.level else (node.module or "")
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


def import_circles(files: list[Path]) -> list[list[str]]:
    """Every set of modules that import each other round a loop (Tarjan's strongly connected
    components of more than one module), each sorted."""
    by_name = {module_name(p): p for p in files}
    graph = {m: module_targets(p, set(by_name)) for m, p in by_name.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def test_no_modules_import_each_other():
    assert import_circles(our_files()) == []


def test_the_circle_check_catches_a_lazy_circle_and_passes_a_facade(tmp_path, monkeypatch):
    """The control: a function-level import that closes a loop is a circle; a package that
    re-exports its module, and a module importing a sibling through the package, are not."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    files = {
        "node/rl/__init__.py": "from node.rl.a import f\n",
        "node/rl/a.py": "from node.rl import b\ndef f():\n    return b\n",
        "node/rl/b.py": "def g():\n    from node.rl.c import h\n",
        "node/rl/c.py": "def h():\n    pass\n",
    }
    for name, source in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(source)
    paths = sorted(tmp_path.rglob("*.py"))
    assert import_circles(paths) == []
    (tmp_path / "node/rl/c.py").write_text("def h():\n    from node.rl.a import f\n")
    assert import_circles(paths) == [["node.rl.a", "node.rl.b", "node.rl.c"]]


def test_importing_protocol_loads_no_torch():
    code = "import sys, protocol; print('torch' in sys.modules, 'node' in sys.modules, 'libp2p' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False", "False"]
