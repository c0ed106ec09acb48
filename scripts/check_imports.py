"""Check the import graph of ``src/vllm_unified`` (stdlib ``ast`` only; imports no project code).

Rules, each violation one line ``file:line: what`` and a non-zero exit status:

* no cycle between modules (every import counts: module-level, under ``if TYPE_CHECKING:``,
  inside functions; ``from pkg import mod`` is an import of ``pkg.mod`` when that is a module);
* no cycle between packages, where a package is one top-level unit of the tree: a top-level
  folder with everything under it, or a top-level module (``kv -> forward_context -> kv``);
* an import of one of our own modules inside a function carries its reason on the same line or
  the line above, as ``# lazy: <reason>`` (what must stay lazy: MLX only after the BLAS
  interposition, no MLX in a process vLLM imports the plugin into before it forks);
* vLLM is imported only by the modules of :data:`VLLM_ALLOWED` (any ``import vllm...``).

Usage: ``python scripts/check_imports.py [ROOT]`` (ROOT: the package folder, default
``src/vllm_unified``); ``--graph`` also prints every module's imports of our own modules.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_ROOT = Path(__file__).resolve().parent.parent / "src" / "vllm_unified"
#: Modules (relative to the root, dotted) that may import vLLM: the compatibility seam and the
#: patches of vLLM's own modules.
VLLM_ALLOWED = frozenset({"compat", "patches"})
LAZY_MARK = "# lazy:"


@dataclass
class Module:
    name: str  # dotted, the root package included: "vllm_unified.kv.pool"
    path: Path
    is_package: bool
    lines: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Import:
    target: str  # dotted module name
    line: int
    lazy: bool  # inside a function body


def discover(root: Path) -> dict[str, Module]:
    """Every ``.py`` file under ``root`` by dotted name (the root folder's name first)."""
    modules: dict[str, Module] = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        name = ".".join(parts)
        modules[name] = Module(name, path, is_package,
                               path.read_text(encoding="utf-8").splitlines())
    return modules


def _walk(node: ast.AST, lazy: bool) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, lazy
        inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        yield from _walk(child, inner)


def _base(mod: Module, node: ast.ImportFrom) -> str:
    """The absolute module an ``ImportFrom`` names (relative levels resolved)."""
    if node.level == 0:
        return node.module or ""
    package = mod.name.split(".") if mod.is_package else mod.name.split(".")[:-1]
    package = package[: len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


def imports_of(mod: Module, modules: dict[str, Module]) -> list[Import]:
    """Every import in ``mod``, targets resolved to modules of ``modules`` where they are ours
    (``from pkg import mod`` -> ``pkg.mod``), else left as written."""
    found: list[Import] = []
    tree = ast.parse("\n".join(mod.lines), filename=str(mod.path))
    for node, lazy in _walk(tree, False):
        if isinstance(node, ast.Import):
            found += [Import(alias.name, node.lineno, lazy) for alias in node.names]
            continue
        base = _base(mod, node)
        subs = [f"{base}.{alias.name}" for alias in node.names]
        found += [Import(s, node.lineno, lazy) for s in subs if s in modules]
        if not all(s in modules for s in subs):
            found.append(Import(base, node.lineno, lazy))
    return found


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one node (cycles), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def package_of(name: str, root: str) -> str:
    """The top-level unit of a module: ``vllm_unified.kv.gpu.paged`` -> ``kv``."""
    parts = name.split(".")[1:]
    return parts[0] if parts else root


def _rel(mod: Module, cwd: Path) -> str:
    try:
        return str(mod.path.resolve().relative_to(cwd))
    except ValueError:
        return str(mod.path)


def _reason(mod: Module, line: int) -> str:
    """The ``# lazy: <reason>`` of the import at ``line`` (same line or the line above), or
    "" when there is none."""
    here = mod.lines[line - 1]
    above = mod.lines[line - 2].strip() if line >= 2 else ""
    if LAZY_MARK in here:
        return here.split(LAZY_MARK, 1)[1].strip()
    return above[len(LAZY_MARK):].strip() if above.startswith(LAZY_MARK) else ""


def check(root: Path, show_graph: bool = False) -> list[str]:
    """All violations under ``root``, one line each (``file:line: what``)."""
    cwd = Path.cwd().resolve()
    modules = discover(root)
    top = root.name
    graph: dict[str, set[str]] = {name: set() for name in modules}
    where: dict[tuple[str, str], tuple[Module, int]] = {}
    problems: list[str] = []
    for mod in modules.values():
        for imp in imports_of(mod, modules):
            rel = mod.name[len(top) + 1:] if mod.name != top else "__init__"
            if (imp.target == "vllm" or imp.target.startswith("vllm.")) and \
                    rel not in VLLM_ALLOWED:
                problems.append(f"{_rel(mod, cwd)}:{imp.line}: imports vLLM ({imp.target}) "
                                f"outside {', '.join(sorted(VLLM_ALLOWED))}")
            if imp.target not in modules or imp.target == mod.name:
                continue
            if imp.lazy and not _reason(mod, imp.line):
                problems.append(f"{_rel(mod, cwd)}:{imp.line}: import of {imp.target} inside "
                                f"a function without a '{LAZY_MARK} <reason>' comment")
            graph[mod.name].add(imp.target)
            where.setdefault((mod.name, imp.target), (mod, imp.line))
    for component in strongly_connected(graph):
        members = set(component)
        for a in component:
            for b in sorted(graph[a] & members):
                mod, line = where[(a, b)]
                problems.append(f"{_rel(mod, cwd)}:{line}: module cycle "
                                f"[{' <-> '.join(component)}]: {a} imports {b}")
    packages: dict[str, set[str]] = {}
    for a, targets in graph.items():
        pa = package_of(a, top)
        packages.setdefault(pa, set())
        packages[pa] |= {package_of(b, top) for b in targets} - {pa}
    for component in strongly_connected(packages):
        members = set(component)
        for (a, b), (mod, line) in sorted(where.items()):
            pa, pb = package_of(a, top), package_of(b, top)
            if pa != pb and pa in members and pb in members:
                problems.append(f"{_rel(mod, cwd)}:{line}: package cycle "
                                f"[{' <-> '.join(component)}]: {a} imports {b}")
    if show_graph:
        for name in sorted(graph):
            print(f"{name} -> {', '.join(sorted(graph[name])) or '-'}")
    return problems


def lazy_imports(root: Path) -> list[str]:
    """Every import of our own modules inside a function, with its reason (a report)."""
    cwd = Path.cwd().resolve()
    modules = discover(root)
    rows = []
    for mod in modules.values():
        for imp in imports_of(mod, modules):
            if imp.lazy and imp.target in modules and imp.target != mod.name:
                reason = _reason(mod, imp.line) or "(no reason)"
                rows.append(f"{_rel(mod, cwd)}:{imp.line}: {imp.target}: {reason}")
    return rows


def main(argv: list[str]) -> int:
    args = [a for a in argv if not a.startswith("--")]
    root = Path(args[0]) if args else DEFAULT_ROOT
    if not (root / "__init__.py").is_file():
        print(f"check_imports: {root} is not a package folder", file=sys.stderr)
        return 2
    problems = check(root, show_graph="--graph" in argv)
    lazy = lazy_imports(root)
    for line in problems:
        print(line)
    print(f"check_imports: {len(problems)} violation(s); {len(lazy)} lazy import(s) of our own "
          "modules, each with its reason:" if lazy else
          f"check_imports: {len(problems)} violation(s); no lazy import of our own modules")
    for row in lazy:
        print(f"  {row}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
