"""House rules about the code's structure, read from the sources (no imports run): no import cycle between the
project's modules (imports inside functions included), utils/ never imports a step's code, and the entry points
import nothing they do not use."""
import ast

from tests.conftest import REPO

SOURCES = sorted(p for p in REPO.rglob("*.py")  # the project's own: no tests, benches, hidden folders (.venv*, .cache)
                 if not p.relative_to(REPO).parts[0].startswith(".")
                 and p.relative_to(REPO).parts[0] not in ("tests", "bench", "scripts", "build"))


def module_name(path):
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in SOURCES}


def project_imports(path) -> set:
    """The project modules ``path`` imports anywhere in it (``from a.b import c`` counts as ``a.b.c`` when that is
    a module, else as ``a.b``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module
                      for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return {m for m in found if m in MODULES and m != module_name(path)}


def test_no_import_cycles_and_utils_never_imports_a_step():
    graph = {m: project_imports(p) for m, p in MODULES.items()}
    assert graph["utils.errors"] == set()  # everything imports it
    assert {m: sorted(d for d in deps if not d.startswith("utils"))
            for m, deps in graph.items() if m.startswith("utils") and any(not d.startswith("utils") for d in deps)} == {}

    def reaches(start, target, seen):
        return any(d == target or (d not in seen and not seen.add(d) and reaches(d, target, seen))
                   for d in graph[start])

    assert [m for m in graph if reaches(m, m, set())] == []


def unused_imports(path) -> list:
    tree = ast.parse(path.read_text())
    imported = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)) and getattr(node, "module", None) != "__future__":
            for a in node.names:
                imported.setdefault((a.asname or a.name).split(".")[0], node.lineno)
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    return [f"{path.relative_to(REPO)}:{line}: {name}" for name, line in imported.items() if name not in used]


def test_entry_points_import_nothing_unused():
    entry_points = [p for p in SOURCES if 'if __name__ == "__main__"' in p.read_text()]
    assert len(entry_points) >= 8  # train.py, chat.py, the four steps' main.py, rw_eval, prompt_eval, ...
    assert [line for p in entry_points for line in unused_imports(p)] == []
