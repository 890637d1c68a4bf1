"""One name, one meaning (STYLE.md habit 16): no two classes of ralm share a name."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).parents[1] / "src" / "ralm"


def test_no_two_classes_share_a_name():
    where = defaultdict(list)
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                where[node.name].append(f"{path.relative_to(SRC)}:{node.lineno}")
    shared = {name: places for name, places in where.items() if len(places) > 1}
    assert not shared, f"classes sharing a name: {shared}"



# Where naming a side is the design (STYLE.md habit 15): the registry of sides and kinds, the
# per-side settings maps (fusion weights, and `alpha`, the dense weight's older spelling), and
# the side names the HTTP schema offers.
NAMES_A_SIDE = {("retrieval/index/kinds.py", "SIDES"), ("retrieval/index/kinds.py", "KINDS"), ("defaults.py", "FUSION_WEIGHTS"),
                ("retrieval/search/fusion.py", "named"), ("serve/app.py", "SideName")}


def dense_side_names(src: Path = SRC) -> list[str]:
    """The lines of code outside retrieval/index/dense_side.py naming the dense side: its class
    (imported or used) or its name as a string (not in a docstring)."""
    found = set()
    for path in sorted(src.rglob("*.py")):
        rel = str(path.relative_to(src))
        if rel == "retrieval/index/dense_side.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        allowed, docs = set(), set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and any((rel, getattr(t, "id", None)) in NAMES_A_SIDE for t in node.targets):
                allowed.update(id(n) for n in ast.walk(node.value))
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
                docs.add(id(node.value))
        for node in ast.walk(tree):
            named = ((isinstance(node, ast.Constant) and node.value == "dense" and id(node) not in allowed | docs)
                     or (isinstance(node, ast.Name) and node.id == "DenseSide")
                     or (isinstance(node, ast.alias) and node.name == "DenseSide"))
            if named:
                found.add((rel, node.lineno))
    return [f"{rel}:{line}" for rel, line in sorted(found)]


def test_nothing_outside_the_dense_side_names_it():
    """#65 item 3: the trainers, the refresher and the REALM evaluations reach the dense side
    through its module's accessors (`dense_of(version)`, `section_of(manifest)`, ...); general
    objects have no dense-only properties."""
    from ralm.retrieval.search.searcher import LoadedVersion, Searcher

    assert dense_side_names() == []
    assert not {"embeddings", "index"} & set(vars(LoadedVersion)) and "retriever" not in vars(Searcher)
