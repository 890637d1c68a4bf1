"""The layering: data -> encoders -> retrieval -> models -> pipeline -> train / convert -> eval -> serve / demo -> cli.
A module imports only from its own layer or a lower one (lazy imports inside functions too)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).parents[1] / "src" / "ralm"
# shared helpers below everything; the package's __init__ (lazy exports) and __main__ on top
LAYERS = {"errors": 0, "renamed": 0, "configs": 0, "atomic": 0, "runtime": 0, "progress": 0, "distributed": 0, "rundir": 0, "defaults": 0, "data": 1,
          "encoders": 2, "retrieval": 3, "models": 4, "pipeline": 5, "train": 6, "convert": 6, "eval": 7, "serve": 8, "demo": 8,
          "console": 9, "commands": 9, "cli": 9, "__main__": 10, "__init__": 10}


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(tree: ast.AST) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "ralm":
            out.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "ralm"]
    return out


def test_no_module_imports_from_a_higher_layer():
    back = []
    for path in sorted(SRC.rglob("*.py")):
        module = "ralm." + ".".join(path.relative_to(SRC).with_suffix("").parts)
        assert _layer(module) in LAYERS, f"{module}: a new top-level module needs a layer in this test"
        for line, name in _imports(ast.parse(path.read_text(encoding="utf-8"))):
            if name == "ralm":  # `import ralm` for __version__; its exports load lazily
                continue
            if LAYERS[_layer(name)] > LAYERS[_layer(module)]:
                back.append(f"{path.relative_to(SRC)}:{line} imports {name}")
    assert not back, "imports against the layering:\n" + "\n".join(back)
