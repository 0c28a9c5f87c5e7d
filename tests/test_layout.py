"""The house's import rule, read from the source (ast): gppo.py is pure math and imports none of the
project's modules; infra/ is machinery below the top-level files and imports only infra/ and
libraries (it is handed what it needs of gppo.py, data/ or the trainer); nothing imports in a circle.
"""
import ast
import os

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
OURS = ("train", "gppo", "rollout", "reward", "eval", "infra", "data", "bench", "tests")


def project_imports(path):
    """The project's modules a file imports (anywhere in it, functions included), as dotted names."""
    tree = ast.parse(open(path).read(), path)
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names
                                      if node.module in ("infra", "data")}
    return {n for n in names if n.split(".")[0] in OURS}


def module_files():
    files = {m: os.path.join(ROOT, f"{m}.py") for m in ("train", "gppo", "rollout", "reward", "eval")}
    for pkg in ("infra", "data"):
        for f in os.listdir(os.path.join(ROOT, pkg)):
            if f.endswith(".py") and f != "__init__.py":
                files[f"{pkg}.{f[:-3]}"] = os.path.join(ROOT, pkg, f)
    return files


def test_gppo_imports_nothing_of_the_project():
    assert project_imports(os.path.join(ROOT, "gppo.py")) == set()


def test_infra_imports_only_infra_and_libraries():
    for name, path in module_files().items():
        if name.startswith("infra."):
            above = {n for n in project_imports(path) if not n.startswith("infra")}
            assert not above, f"{name} imports {sorted(above)}"


def test_no_import_circle():
    files = module_files()
    graph = {m: {n for n in project_imports(p) if n in files} for m, p in files.items()}
    done, path = set(), []

    def visit(m):
        assert m not in path, f"import circle: {' -> '.join(path[path.index(m):] + [m])}"
        if m in done:
            return
        path.append(m)
        for n in sorted(graph[m]):
            visit(n)
        path.pop()
        done.add(m)

    for m in sorted(graph):
        visit(m)
