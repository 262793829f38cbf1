"""How the packages depend on each other, read from the source (every import statement,
function-level ones included): no import cycles in backend/, the layering rules hold,
and the torch-free parts stay torch-free when imported."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(package_root: Path, top: str) -> dict[str, set[str]]:
    """module -> the modules of the same top-level package it imports (anywhere in it)."""
    base = package_root.parent
    modules = {_module_name(p, base): p for p in package_root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_pkg = path.name == "__init__.py"
        package = name if is_pkg else name.rpartition(".")[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[:len(anchor) - node.level + 1]
                    prefix = ".".join(anchor + ([node.module] if node.module else []))
                else:
                    prefix = node.module or ""
                targets = [prefix] + [f"{prefix}.{alias.name}" for alias in node.names]
            for target in targets:
                # the deepest module of the package the import names
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target.split(".")[0] == top and target != name:
                    found.add(target)
        graph[name] = found
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            # a package's __init__ importing its own modules is not a cycle back to them
            if node.startswith(dep + ".") and dep in graph:
                continue
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycles_in_the_backend():
    graph = import_graph(ROOT / "backend", "backend")
    assert len(graph) > 30
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_cycle_finder_finds_a_function_level_cycle(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from .a import g\n")
    assert find_cycle(import_graph(pkg, "pkg")) == ["pkg.a", "pkg.b", "pkg.a"]


def test_the_layers_point_one_way():
    graph = import_graph(ROOT / "backend", "backend")
    core = {m for m in graph if m.startswith("backend.core")}
    for module in core:  # the engine knows nothing of the serving layer or Triton
        assert all(dep.startswith("backend.core") for dep in graph[module]), module
    policy = ["backend.core.scheduler", "backend.core.radix_cache", "backend.core.request",
              "backend.core.kv_allocator", "backend.core.radix_node", "backend.core.tiers",
              "backend.core.radix_integrity", "backend.core.schedule_plan",
              "backend.core.eviction", "backend.core.reuse_model", "backend.core.host_tier"]
    device = {"backend.core.model_runner", "backend.core.forward_step", "backend.core.memory_pool",
              "backend.core.transfer", "backend.core.sampling", "backend.core.engine",
              "backend.core.host_memory"}
    for module in policy:
        assert not graph[module] & device, (module, graph[module] & device)
    sources = "\n".join(p.read_text() for p in (ROOT / "clients").rglob("*.py"))
    assert "import backend" not in sources and "from backend" not in sources


def test_no_core_module_imports_triton_python_backend_utils():
    for path in (ROOT / "backend" / "core").rglob("*.py"):
        assert "triton_python_backend_utils" not in path.read_text(), path


@pytest.mark.parametrize("modules", [
    "backend.core.scheduler backend.core.radix_cache backend.core.request "
    "backend.core.radix_node backend.core.radix_integrity backend.core.schedule_plan "
    "backend.core.kv_allocator backend.core.groups backend.core.eviction "
    "backend.core.tiers backend.core.host_tier backend.core.reuse_model",
    "backend.core.detokenizer",
    "backend.wire backend.engine_protocol backend.runtime_dir",
])
def test_importing_these_does_not_import_torch(modules):
    code = (f"import sys\nimport {', '.join(modules.split())}\n"
            "heavy = sorted({'torch', 'transformers'} & set(sys.modules))\n"
            "assert not heavy, heavy\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_the_ensembles_text_steps_load_without_torch():
    from conftest import ensure_default_model

    default_model = ensure_default_model()
    code = ("import sys\nsys.path.insert(0, 'ensemble')\nimport textproc\n"
            f"tok = textproc.load_tokenizer({str(default_model)!r})\n"
            "assert tok.decode(tok.encode('hello world')) == 'hello world'\n"
            "assert 'torch' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
