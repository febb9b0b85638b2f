"""The import structure of the ``ucm`` package, read from the source with ``ast``.

* No import cycles between modules, counting every import: at module level,
  inside functions and under ``TYPE_CHECKING``.
* No module imports a private name (``_x``) of another module.
* ``ucm.sparse`` knows no inference engine: it imports neither vLLM nor the
  integration and takes no vLLM config (its methods are built from
  ``SparseModelInfo``); nothing else in the package imports ``ucm.testing``
  (the conformance suite, for users' tests) or ``ucm.vllm_demo`` (the
  README's main job), and no module of it imports the tests' helpers
  (``support``) or pytest.

Known exceptions are listed with the reason they are still there.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "ucm"

#: Cycles still allowed: none.
KNOWN_CYCLES: set[frozenset[str]] = set()

#: (importer, module, name) of private imports still allowed: none.
KNOWN_PRIVATE_IMPORTS: set[tuple[str, str, str]] = set()

#: The compiled extension is private to the package; its Python wrappers import it.
NATIVE = "ucm._native"


@dataclass(frozen=True)
class Import:
    importer: str
    module: str  # the ucm module (or package) imported from
    name: str | None  # the name imported from it (None: ``import module``)
    line: int


def module_names() -> dict[str, Path]:
    """Dotted name -> file of every module and package of ``ucm``."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports_of(name: str, path: Path) -> list[Import]:
    """Every import of a ucm module in one file, wherever it stands."""
    is_package = path.name == "__init__.py"
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [Import(name, a.name, None, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".") if is_package else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - node.level + 1]
                base = ".".join([*pkg, base] if base else pkg)
            out += [Import(name, base, a.name, node.lineno) for a in node.names]
    return [i for i in out if i.module == "ucm" or i.module.startswith("ucm.")]


def all_imports() -> list[Import]:
    return [i for name, path in module_names().items() for i in imports_of(name, path)]


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules it imports (``from pkg import mod`` counts as ``pkg.mod``)."""
    modules = module_names()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for i in all_imports():
        target = (
            f"{i.module}.{i.name}" if i.name and f"{i.module}.{i.name}" in modules else i.module
        )
        if target in modules and target != i.importer:
            graph[i.importer].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_the_checks_see_the_package() -> None:
    graph = import_graph()
    assert len(graph) > 50
    assert "ucm.sparse.factory" in graph["ucm.sparse.config"]
    assert "ucm.integration.vllm.transfer" in graph["ucm.integration.vllm.worker"]
    # The cycle finder finds a cycle through a function-level import.
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [frozenset("abc")]


def test_no_import_cycles() -> None:
    found = [c for c in cycles(import_graph()) if c not in KNOWN_CYCLES]
    assert not found, "import cycles: " + "; ".join(" <-> ".join(sorted(c)) for c in found)


def test_no_private_names_imported_from_other_modules() -> None:
    bad = []
    for i in all_imports():
        if not any(_private(p) for p in [*i.module.split("."), i.name or ""]):
            continue
        if NATIVE in (i.module, f"{i.module}.{i.name}"):
            continue
        if (i.importer, i.module, i.name) in KNOWN_PRIVATE_IMPORTS:
            continue
        bad.append(f"{i.importer}:{i.line} imports {i.module}.{i.name or ''}")
    assert not bad, "\n".join(bad)


def test_layers() -> None:
    bad = []
    for i in all_imports():
        if i.importer.startswith("ucm.sparse") and i.module.startswith("ucm.integration"):
            bad.append(f"{i.importer}:{i.line}: ucm.sparse must not import the engine integration")
        for tool in ("ucm.testing", "ucm.vllm_demo"):
            if i.module.startswith(tool) and not i.importer.startswith(tool):
                bad.append(f"{i.importer}:{i.line}: only tests and {tool} itself import {tool}")
    for name, path in module_names().items():
        if name.startswith("ucm.sparse"):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                mods = []
                if isinstance(node, ast.Import):
                    mods = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and not node.level:
                    mods = [node.module or ""]
                if any(m == "vllm" or m.startswith("vllm.") for m in mods):
                    bad.append(f"{name}:{node.lineno}: ucm.sparse must not import vLLM")
    assert not bad, "\n".join(bad)


def test_sparse_methods_take_no_vllm_config() -> None:
    # The vLLM integration reads its config into a SparseModelInfo; a method
    # that took the config itself would tie ucm.sparse to one engine again.
    bad = [
        f"{name}:{n}"
        for name, path in sorted(module_names().items())
        if name == "ucm.sparse" or name.startswith("ucm.sparse.")
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if "vllm_config" in line.lower()
    ]
    assert not bad, "ucm.sparse mentions vllm_config at " + ", ".join(bad)


def test_the_package_ships_no_test_tooling() -> None:
    bad = []
    for name, path in module_names().items():
        for node in ast.walk(ast.parse(path.read_text())):
            mods = []
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                mods = [node.module or ""]
            for m in mods:
                if m.split(".")[0] in ("support", "pytest"):
                    bad.append(f"{name}:{node.lineno} imports {m} (test tooling)")
    assert not bad, "\n".join(bad)


#: A file longer than this says why at its top (see `test_long_files_say_why`).
LONG_FILE_LINES = 620
REPO = PACKAGE.parents[1]


def _head_comment(path: Path) -> str:
    """The module docstring of a Python file, or the leading ``//!`` lines of a Rust one."""
    text = path.read_text()
    if path.suffix == ".py":
        return ast.get_docstring(ast.parse(text)) or ""
    head = []
    for line in text.splitlines():
        if not line.startswith("//!"):
            break
        head.append(line)
    return "\n".join(head)


def test_long_files_say_why() -> None:
    files = [*PACKAGE.rglob("*.py"), *(REPO / "rust").glob("*/src/**/*.rs")]
    assert len(files) > 100
    silent = [
        f"{path.relative_to(REPO)} ({n} lines)"
        for path in sorted(files)
        if (n := len(path.read_text().splitlines())) > LONG_FILE_LINES
        and "Over 600 lines" not in _head_comment(path)
    ]
    assert not silent, "long files without a reason at their top: " + ", ".join(silent)
