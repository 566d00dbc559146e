"""No import cycles between lightning_mcore's packages, function-level imports included: data
flows one way (model <- hf <- models <- strategy/objectives <- callbacks <- cli)."""

import ast
from pathlib import Path

import lightning_mcore

ROOT = Path(lightning_mcore.__file__).parent


def node(module: str) -> str:
    """The package (or top-level module) a dotted lightning_mcore module belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "lightning_mcore"


def imports(path: Path) -> set[str]:
    """Every lightning_mcore module `path` imports, at any depth of its code."""
    here = "lightning_mcore." + ".".join(path.relative_to(ROOT).with_suffix("").parts)
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


def test_the_check_sees_a_cycle_and_function_level_imports():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None
    edges = graph()
    assert "strategy" in edges["objectives"]  # objectives/base.py imports it inside functions
    assert "models" in edges["objectives"] and "hf" in edges["models"]
    assert not edges["model"] - {"quiet", "atomic", "refusals"}, edges["model"]
