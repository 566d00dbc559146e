"""No import cycles, function-level imports included: between lightning_mcore's packages, data
flows one way (sequence <- model <- lora <- hf, generation <- models <- strategy/objectives <-
callbacks <- cli); inside each package, between its modules too (a cycle there means a piece two
modules share belongs in a module of its own). And no import inside a function without a comment
saying why it is there (an optional dependency, a heavy one kept off start-up, ...)."""

import ast
import io
import tokenize
from pathlib import Path

import lightning_mcore

ROOT = Path(lightning_mcore.__file__).parent


def node(module: str) -> str:
    """The package (or top-level module) a dotted lightning_mcore module belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "lightning_mcore"


def dotted(path: Path, root: Path = ROOT) -> str:
    """lightning_mcore.pkg.module for a file under `root` (a package's __init__: the package)."""
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(("lightning_mcore",) + (parts[:-1] if parts[-1] == "__init__" else parts))


def imports(path: Path, root: Path = ROOT) -> set[str]:
    """Every lightning_mcore module `path` imports, at any depth of its code (for `from a import
    b`: both a and a.b, whichever of them is a module)."""
    here = "lightning_mcore." + ".".join(path.relative_to(root).with_suffix("").parts)
    found = set()
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.Import):
            found |= {a.name for a in n.names}
        elif isinstance(n, ast.ImportFrom):
            base = n.module or ""
            if n.level:  # relative import
                anchor = here.split(".")[: -n.level] if not path.name == "__init__.py" else \
                    here.split(".")[: -n.level + 1 or None]
                base = ".".join(anchor + ([base] if base else []))
            found |= {f"{base}.{a.name}" for a in n.names} | {base}
    return {m for m in found if m.startswith("lightning_mcore.")}


def graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        src = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        if src == "__init__":
            continue  # the package's public names: it may import anything
        targets = {node(m) for m in imports(path)} - {src, "lightning_mcore"}
        # `from lightning_mcore import quiet` names a top-level module
        targets = {t for t in targets if (ROOT / t).is_dir() or (ROOT / f"{t}.py").is_file()}
        edges.setdefault(src, set()).update(targets)
    return edges


def module_graphs(root: Path = ROOT) -> dict[str, dict[str, set[str]]]:
    """For each package (lightning_mcore itself for the top-level modules), which of its modules
    imports which other of its modules. An __init__ is left out, as in graph()."""
    modules = {dotted(p, root): p for p in root.rglob("*.py") if p.name != "__init__.py"}
    graphs: dict[str, dict[str, set[str]]] = {}
    for name, path in modules.items():
        package = name.rpartition(".")[0]
        inside = {m for m in imports(path, root) if m in modules and m != name and m.rpartition(".")[0] == package}
        graphs.setdefault(package, {})[name] = inside
    return graphs


def cycle(edges: dict[str, set[str]]):
    """One cycle as a list of nodes, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(edges.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        state[n] = 2
        stack.pop()
        return None

    for n in sorted(edges):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_no_import_cycle_between_packages():
    found = cycle(graph())
    assert found is None, "import cycle: " + " -> ".join(found)


def test_no_import_cycle_between_the_modules_of_a_package():
    found = {package: cycle(edges) for package, edges in module_graphs().items()}
    found = {package: c for package, c in found.items() if c}
    assert not found, "; ".join(f"import cycle in {p}: " + " -> ".join(c) for p, c in found.items())


def test_the_check_sees_a_cycle_and_function_level_imports():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None
    edges = graph()
    assert "strategy" in edges["objectives"]  # objectives/base.py
    assert "models" in edges["objectives"] and "hf" in edges["models"]
    assert not edges["sequence"] - {"quiet", "atomic", "refusals"}, edges["sequence"]
    assert not edges["model"] - {"sequence", "quiet", "atomic", "refusals"}, edges["model"]
    assert not edges["lora"] - {"model", "sequence"}, edges["lora"]
    assert "lora" in edges["generation"]  # decode_graphs.py
    assert "generation" not in edges["hf"] | edges["lora"] | edges["model"]
    modules = module_graphs()
    # between the modules of a package: kv_cache.py imports decode_graphs.py
    assert "lightning_mcore.generation.decode_graphs" in modules["lightning_mcore.generation"][
        "lightning_mcore.generation.kv_cache"]
    assert "lightning_mcore.cli_errors" in modules["lightning_mcore"]["lightning_mcore.cli"]


def test_the_module_check_fails_on_a_cycle_inside_a_package(tmp_path):
    """A stand-in package whose two modules import each other, one of them inside a function."""
    package = tmp_path / "lightning_mcore" / "pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from lightning_mcore.pkg import b\n")
    (package / "b.py").write_text("def f():\n    from lightning_mcore.pkg.a import x\n")
    (package / "c.py").write_text("from lightning_mcore.pkg import a\n")
    graphs = module_graphs(tmp_path / "lightning_mcore")
    assert cycle(graphs["lightning_mcore.pkg"]) == ["lightning_mcore.pkg.a", "lightning_mcore.pkg.b",
                                                     "lightning_mcore.pkg.a"]


def function_level_imports(path: Path) -> list[ast.stmt]:
    """The import statements of `path` inside a function (at any depth)."""
    found = []
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            found += [i for i in ast.walk(n) if isinstance(i, (ast.Import, ast.ImportFrom))]
    return sorted(set(found), key=lambda i: i.lineno)


def unexplained_imports(root: Path = ROOT) -> list[str]:
    """`path:line` of each function-level import with no comment on its line or the line above;
    in a run of imports on consecutive lines, the first one's comment covers the run."""
    found = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        commented = {t.start[0] for t in tokenize.generate_tokens(io.StringIO(text).readline)
                     if t.type == tokenize.COMMENT}
        follows = set()  # lines that continue a run of imports
        for stmt in function_level_imports(path):
            explained = {stmt.lineno, stmt.lineno - 1} & commented or stmt.lineno in follows
            if explained:
                follows.add(stmt.end_lineno + 1)
            else:
                found.append(f"{path.relative_to(root.parent)}:{stmt.lineno}")
    return found


def test_every_function_level_import_says_why():
    """An import inside a function either moves to the module's top or says why it must stay
    (`# lazy: ...`, `# optional dependency (...)`): what `import lightning_mcore` already loads
    costs nothing at the top, and a hidden cycle is fixed by moving code, not hidden."""
    found = unexplained_imports()
    assert not found, "function-level imports without a comment saying why: " + ", ".join(found)


def test_the_comment_check_fails_on_an_unexplained_import(tmp_path):
    package = tmp_path / "lightning_mcore"
    package.mkdir()
    (package / "a.py").write_text(
        "import os\n\n\n"
        "def explained():\n"
        "    import json  # lazy: a stand-in reason\n"
        "    import csv\n\n"  # the run the comment above covers
        "    # optional dependency (a stand-in)\n"
        "    import zlib\n\n\n"
        "def unexplained():\n"
        "    x = 1\n"
        "    import json\n"
        "    return json, x\n")
    assert unexplained_imports(package) == ["lightning_mcore/a.py:14"]
