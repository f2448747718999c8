"""speculators' model families the EAGLE-3 trainer never uses, imported only when something asks for them.

`import speculators` runs its package `__init__`, which imports every model family (`speculators/models/__init__.py`:
dflash, dflash2, dspark, eagle3, mtp, peagle, xpress) and re-exports their classes; dflash alone pulls in Qwen3's
modelling code and more. The trainer reaches only eagle3 (and mtp's `data` module, which speculators' CLI imports).

`install()` puts a finder first on `sys.meta_path` for exactly two modules, `speculators` and `speculators.models`,
before either is imported. Their loader runs each package's own `__init__` source, with one change made on its
syntax tree: a `from .family import Name` whose module is one of `LAZY_FAMILIES` (or a name the package re-exports
from one) binds nothing at import; the name is listed in the module's `_eyrie_lazy` table and a module-level
`__getattr__` (PEP 562) imports the family on the first access, binds the name, and reloads speculators' schemas so
the family's registered config classes are known, as they would have been. Everything else in those files, and every
other module, runs unchanged. `speculators.models.dflash` imported by name still imports it at once.

Off (switches.LAZY_SPECULATORS_IMPORTS) or once speculators is imported, `install` does nothing.
"""

from __future__ import annotations

import ast
import importlib
import importlib.abc
import importlib.machinery
import os
import sys
from types import ModuleType
from typing import Any

PACKAGES = ("speculators", "speculators.models")  # the two __init__ files rewritten
LAZY_FAMILIES = frozenset(f"speculators.models.{f}" for f in ("dflash", "dflash2", "dspark", "mtp", "peagle", "xpress"))


def _absolute(package: str, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
    return f"{base}.{node.module}" if node.module else base


class _LazyNames(ast.NodeTransformer):
    """`from M import a, b as c` at module level: names whose source is a lazy family go to `table` ({bound name:
    (module, attribute)}), the rest stay in the statement (dropped when none is left)."""

    def __init__(self, package: str, path: str) -> None:
        self.package = package
        self.path = path  # the package's __init__.py
        self.table: dict[str, tuple[str, str]] = {}

    def _inherited(self, source: str) -> dict[str, tuple[str, str]]:
        """The lazy names of `source`, a rewritten package below this one, read from its file before it runs."""
        if source in sys.modules:
            return getattr(sys.modules[source], "_eyrie_lazy", {})
        if source not in PACKAGES or not source.startswith(self.package + "."):
            return {}
        path = os.path.join(os.path.dirname(self.path), *source[len(self.package) + 1 :].split("."), "__init__.py")
        if not os.path.isfile(path):
            return {}
        with open(path, "rb") as f:
            rewrite = _LazyNames(source, path)
            rewrite.visit(ast.parse(f.read(), filename=path))
        return rewrite.table

    def visit_ImportFrom(self, node: ast.ImportFrom) -> Any:
        source = _absolute(self.package, node)
        inherited = self._inherited(source)
        keep = []
        for alias in node.names:
            bound = alias.asname or alias.name
            if source in LAZY_FAMILIES and alias.name != "*":
                self.table[bound] = (source, alias.name)
            elif alias.name in inherited:
                self.table[bound] = inherited[alias.name]
            else:
                keep.append(alias)
        if not keep:
            return None
        node.names = keep
        return node

    # only module-level statements: nested scopes keep their imports
    def visit_FunctionDef(self, node: ast.FunctionDef) -> Any:
        return node

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]
    visit_ClassDef = visit_FunctionDef  # type: ignore[assignment]


def _module_getattr(module: ModuleType):
    def __getattr__(name: str) -> Any:
        target = module.__dict__.get("_eyrie_lazy", {}).get(name)
        if target is None:
            raise AttributeError(f"module {module.__name__!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(target[0]), target[1])
        setattr(module, name, value)
        reload = getattr(sys.modules.get("speculators"), "reload_schemas", None)
        if reload is not None:  # the family's config classes registered since the last reload
            reload()
        return value

    return __getattr__


class _RewritingLoader(importlib.machinery.SourceFileLoader):
    def get_code(self, fullname: str) -> Any:  # type: ignore[override]
        path = self.get_filename(fullname)
        tree = ast.parse(self.get_data(path), filename=path)
        rewrite = _LazyNames(fullname, path)
        tree = ast.fix_missing_locations(rewrite.visit(tree))
        self._tables[fullname] = rewrite.table
        return compile(tree, path, "exec", dont_inherit=True)

    def exec_module(self, module: ModuleType) -> None:
        code = self.get_code(module.__name__)
        module.__dict__["_eyrie_lazy"] = self._tables.pop(module.__name__)
        module.__dict__["__getattr__"] = _module_getattr(module)
        exec(code, module.__dict__)

    _tables: dict[str, dict[str, tuple[str, str]]] = {}


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in PACKAGES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or not isinstance(spec.loader, importlib.machinery.SourceFileLoader):
            return spec
        spec.loader = _RewritingLoader(fullname, spec.loader.path)
        return spec


def install() -> bool:
    """The finder, first on sys.meta_path, unless speculators is imported already (then nothing: True when
    installed)."""
    if "speculators" in sys.modules or any(isinstance(f, _Finder) for f in sys.meta_path):
        return False
    sys.meta_path.insert(0, _Finder())
    return True


def load_families_for(speculator_type: str) -> None:
    """A speculator type that none of the imported families registered: import the lazy ones (their classes register
    themselves), so speculators' own lookup finds it, or lists every type, as without the finder."""
    speculators = sys.modules.get("speculators")
    if speculators is None:
        return
    from speculators.model import SpeculatorModel

    if SpeculatorModel.registry and speculator_type in SpeculatorModel.registry:
        return
    for name in list(getattr(speculators, "_eyrie_lazy", {})):
        getattr(speculators, name)
