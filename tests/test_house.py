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


# --------------------------------------------------------------------------- floors

def room(module: str) -> str:
    """The room a utils module stands in: a sub-package (utils.data, utils.model) is one room, as a floor plan draws
    a folder; any other module is a room of its own."""
    return ".".join(module.split(".")[:2])


def room_imports() -> dict:
    """``{room: {room it imports: ["module -> module", ...]}}`` over utils/, a room's imports of itself left out."""
    rooms = {}
    for m, p in MODULES.items():
        if m.startswith("utils."):
            for d in sorted(project_imports(p)):
                if d.startswith("utils.") and room(d) != room(m):
                    rooms.setdefault(room(m), {}).setdefault(room(d), []).append(f"{m} -> {d}")
    return rooms


# The imports that ran back up a floor until issue 56: the data below the reward functions (the phase-3 row's
# reference key now lives with the loader), the data below the argument groups (the IFEval builder is bench/'s
# now), the models below generation (a causal LM's answers, utils/answers.py, stand on generation).
WENT_BACK_UP = (("utils.data", "utils.reward_functions"), ("utils.data", "utils.arguments"),
                ("utils.model", "utils.generation"))
TOP_FLOORS = ("bench", "scripts", "tests")  # what stands on utils/, besides the steps, train.py, chat.py and inference


def test_no_import_in_utils_runs_back_up_a_floor():
    """utils/ is built in floors: each room (a module, or utils.data / utils.model as a whole) stands above all that
    it imports, so the rooms' imports make no circle, and nothing in utils/ reaches up to the benches, scripts or
    tests. Named here: the three pairs that once ran back up."""
    rooms = room_imports()
    assert {f"{a} -> {b}": rooms[a][b] for a, b in WENT_BACK_UP if b in rooms.get(a, {})} == {}

    def reach(start):
        seen, todo = set(), [start]
        while todo:
            for nxt in rooms.get(todo.pop(), {}):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    reached = {r: reach(r) for r in {room(m) for m in MODULES if m.startswith("utils.")}}
    back_up = {f"{a} -> {b}": how for a, to in rooms.items() for b, how in to.items() if a in reached[b]}
    assert back_up == {}, "rooms of utils/ that import each other (one of each pair runs back up a floor)"
    upward = [f"{p.relative_to(REPO)}:{node.lineno}: {name}" for m, p in MODULES.items() if m.startswith("utils")
              for node in ast.walk(ast.parse(p.read_text()))
              for name in ([a.name for a in node.names] if isinstance(node, ast.Import) else
                           [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level
                           else [])
              if name.split(".")[0] in TOP_FLOORS]
    assert upward == []


# --------------------------------------------------------------------------- sys.path

SHIPPED = sorted(p for p in REPO.rglob("*.py")  # every .py the project ships: benches and scripts too, no tests
                 if not p.relative_to(REPO).parts[0].startswith(".")
                 and p.relative_to(REPO).parts[0] not in ("tests", "build"))


def _is_sys_path(node) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
            and node.value.id == "sys")


def sys_path_edits(path) -> list:
    """The lines of ``path`` that change ``sys.path``: ``sys.path.insert/append/...(...)``, an assignment to it or to
    an item of it, ``site.addsitedir(...)``."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and (
                _is_sys_path(node.func.value) or (node.func.attr == "addsitedir" and isinstance(node.func.value,
                                                                                               ast.Name)
                                                  and node.func.value.id == "site")):
            lines.append(node.lineno)
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(_is_sys_path(t.value if isinstance(t, ast.Subscript) else t) for t in targets):
                lines.append(node.lineno)
    return sorted(lines)


def test_no_shipped_script_edits_sys_path(tmp_path):
    """The project is installed (``pip install -e .``; the steps' runs get it first on PYTHONPATH): its modules import
    it by name, and a bench imports a module beside it by name (Python puts a script's folder first), so no shipped
    file changes ``sys.path``."""
    assert any(p.parts[-2] == "bench" for p in SHIPPED) and any(p.parts[-2] == "scripts" for p in SHIPPED)
    assert {str(p.relative_to(REPO)): sys_path_edits(p) for p in SHIPPED if sys_path_edits(p)} == {}
    edits = tmp_path / "edits.py"
    edits.write_text("import os, site, sys\nsys.path.insert(0, os.getcwd())\nsys.path[0:0] = ['x']\n"
                     "sys.path += ['y']\nsite.addsitedir('z')\nprint(sys.path)\n")
    assert sys_path_edits(edits) == [2, 3, 4, 5]  # reading it is no edit
