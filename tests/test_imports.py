"""Data flows one way: data -> retrieval -> models -> train / convert -> eval -> serve -> the
command line. A module never imports from a layer above its own."""

import ast
from pathlib import Path

import ralm

LAYERS = {"errors": 0, "atomic": 0, "runtime": 0, "progress": 0, "distributed": 0, "data": 1, "retrieval": 2, "models": 3,
          "train": 4, "convert": 4, "eval": 5, "serve": 6, "demo": 6, "commands": 7, "console": 7, "cli": 8, "__main__": 9}


def _layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.get(parts[1]) if parts[0] == "ralm" and len(parts) > 1 else None


def test_no_module_imports_from_a_layer_above_its_own():
    root = Path(ralm.__file__).parent
    back = []
    for path in root.rglob("*.py"):
        module = ".".join(("ralm", *path.relative_to(root).with_suffix("").parts))
        own = _layer(module)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            back += [f"{module} -> {name}" for name in names
                     if own is not None and (other := _layer(name)) is not None and other > own]
    assert not back, back
