"""Call sites read like sentences: a public function or method takes at most four positional
parameters; the rest are keyword-only, so `build_index(docs, out, kind="bm25", batch_size=8)`
says what each value is."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).parents[1] / "src" / "ralm"
MAX_POSITIONAL = 4


def _public_functions(tree: ast.Module):
    """(qualified name, def) of module-level functions and methods of classes, public by name."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
            yield node.name, node
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and (item.name == "__init__"
                                                                                  or not item.name.startswith("_")):
                    yield f"{node.name}.{item.name}", item


def test_public_functions_take_at_most_four_positional_parameters():
    long = []
    for path in sorted(SRC.rglob("*.py")):
        for name, node in _public_functions(ast.parse(path.read_text(encoding="utf-8"))):
            positional = [a.arg for a in node.args.posonlyargs + node.args.args if a.arg not in ("self", "cls")]
            if len(positional) > MAX_POSITIONAL:
                long.append(f"{path.relative_to(SRC)}:{node.lineno} {name}({', '.join(positional)})")
    assert not long, f"more than {MAX_POSITIONAL} positional parameters (make the rest keyword-only):\n" + "\n".join(long)
