"""mgpu's layout holds: imports run one way between its folders, as each folder's __init__.py
says (its `May import:` line), no module imports another in a circle, and modules stay small.

Read from the source with ast, nothing imported: a circle or an upward import fails here on
any machine, before it fails (or, worse, half-works) at import time on one.
"""

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "mgpu"
MAX_LINES = 400

# Kept out of the checks only until the files are split; each entry must still be needed (the
# tests fail on a stale one). None now.
WAITING_CIRCLES: list[set[str]] = []
WAITING_LONG: set[str] = set()


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(name: str) -> set[str]:
    """The mgpu modules `name` imports, at any depth: a function-level import is an edge too,
    since it runs whenever the function does and would make the circle real then. `from a
    import b` counts as importing the module a.b where there is one, else a."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, one level up per extra dot
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names
            ]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:  # `import mgpu.x.y` names a module above y
                target = target.rpartition(".")[0]
            if target.startswith("mgpu") and target != name:
                found.add(target)
    return found


GRAPH = {name: imports(name) for name in MODULES}


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
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
                found.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def folder(name: str) -> str | None:
    """The folder a module belongs to (mgpu.comm.reducer: comm); None for mgpu's own modules."""
    parts = name.split(".")
    return (
        parts[1] if len(parts) > 2 or (len(parts) == 2 and (PACKAGE / parts[1]).is_dir()) else None
    )


FOLDERS = sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py"))


def allowed(name: str) -> set[str]:
    """A folder's `May import:` line: the other folders its modules may import from."""
    doc = ast.get_docstring(ast.parse((PACKAGE / name / "__init__.py").read_text())) or ""
    line = re.search(r"May import: ([^.]*)\.", doc.replace("\n", " "))
    assert line, f"mgpu/{name}/__init__.py's docstring has no 'May import: ...' line"
    text = line.group(1).strip()
    return set() if text == "nothing outside it" else {w.strip() for w in text.split(",")}


def test_no_module_imports_another_in_a_circle():
    found = circles(GRAPH)
    for waiting in WAITING_CIRCLES:
        assert waiting in found, f"{sorted(waiting)} is no circle now: drop it from WAITING_CIRCLES"
    rest = [sorted(c) for c in found if c not in WAITING_CIRCLES]
    assert not rest, f"import circles: {rest}"


def test_the_circle_check_sees_function_level_imports():
    fake = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(fake) == [{"a", "b", "c"}]
    assert "mgpu.data.gpu_resize" in GRAPH["mgpu.data.gpu_decode"]  # imported in a function


def test_every_folder_says_what_it_owns_and_may_import():
    for name in FOLDERS:
        doc = ast.get_docstring(ast.parse((PACKAGE / name / "__init__.py").read_text()))
        assert doc and len(doc) > 60, f"mgpu/{name}/__init__.py: say what the folder owns"
        assert allowed(name) <= set(FOLDERS), f"mgpu/{name}: unknown folders {allowed(name)}"


def test_folders_import_one_way():
    """A module imports its own folder, and the folders its folder's docstring names; no folder
    imports mgpu's own modules (the after-training commands, at the top)."""
    wrong = []
    for name, targets in GRAPH.items():
        home = folder(name)
        if home is None:
            continue  # the commands at the top may import any folder
        for target in targets:
            there = folder(target)
            if there != home and (there is None or there not in allowed(home)):
                wrong.append(f"{name} -> {target}")
    assert not wrong, "imports up or across the layers:\n" + "\n".join(sorted(wrong))
    # the allowances themselves run one way: no two folders may import each other, at any remove
    assert not circles({f: allowed(f) for f in FOLDERS})


def test_modules_stay_small():
    lines = {
        str(p.relative_to(PACKAGE.parent)): len(p.read_text().splitlines())
        for p in PACKAGE.rglob("*.py")
    }
    long = {path for path, n in lines.items() if n > MAX_LINES}
    assert WAITING_LONG <= long, f"no longer over {MAX_LINES}: {sorted(WAITING_LONG - long)}"
    assert long <= WAITING_LONG, f"over {MAX_LINES} lines: {sorted(long - WAITING_LONG)}"
