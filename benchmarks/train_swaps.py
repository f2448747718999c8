"""Count the attributes of other packages (speculators, torch, hs_connectors, transformers) that the train entry's
code replaces at run time: every assignment `name.attr... = value` (and `setattr(name, ...)`, and a registry entry
`X.registry[k] = ...`) whose root `name` was imported from one of those packages, in the files the entry runs
(eyrie/stages/train). Run:
`.venv/bin/python benchmarks/train_swaps.py [--list]`.

48 at the commit that added this script (the entry then also called eyrie/hidden_states/pack_reader.py's and
gpu_decode.py's `install()`, 4 of them, counted with `FILES + HIDDEN_STATES`); the entry composed from speculators'
parts calls neither: its loaders pick those readers directly (eyrie/stages/train/loaders.py). 24 before the drafter's
and the trainer's choices were bound on their own instances (eyrie/stages/train/drafter.py, EyrieTrainer's
`_bind_trainer_view`), 8 after: an attribute set on an object Eyrie built (`drafter.forward = ...`) replaces nothing
of another package, and such names are not imported from one, so they are not counted."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOREIGN = ("speculators", "torch", "hs_connectors", "transformers")
FILES = sorted((ROOT / "eyrie/stages/train").rglob("*.py"))
HIDDEN_STATES = [ROOT / "eyrie/hidden_states/pack_reader.py", ROOT / "eyrie/hidden_states/gpu_decode.py"]


def _foreign_names(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in FOREIGN:
                    names.add((a.asname or a.name).split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in FOREIGN:
            names.update(a.asname or a.name for a in node.names)
    return names


def _root(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def swaps(files=FILES) -> list[str]:
    """`path:line: target` for each replaced attribute of another package."""
    out = []
    for path in files:
        tree = ast.parse(path.read_text())
        foreign = _foreign_names(tree)
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
                if node.args and _root(node.args[0]) in foreign:
                    out.append(f"{path.relative_to(ROOT)}:{node.lineno}: setattr({ast.unparse(node.args[0])}, ...)")
                continue
            for t in targets:
                for el in t.elts if isinstance(t, ast.Tuple) else [t]:
                    if isinstance(el, ast.Subscript):  # a registry entry replaced: `Backend.registry["file"] = ...`
                        el = el.value if isinstance(el.value, ast.Attribute) else el
                    if isinstance(el, (ast.Attribute, ast.Subscript)) and _root(el) in foreign:
                        out.append(f"{path.relative_to(ROOT)}:{el.lineno}: {ast.unparse(el)}")
    return out


if __name__ == "__main__":
    found = swaps(FILES + HIDDEN_STATES if "--with-installers" in sys.argv else FILES)
    if "--list" in sys.argv:
        print("\n".join(found))
    print(len(found))
