"""Reading the package's structure from its source with ``ast``: each module's imports
of the package's own modules (inside functions and under ``TYPE_CHECKING`` too: a circle
of types is still two modules that must change together), the circles they make, and
the private names a module uses but does not define (``obj._name``, ``from module import
_name``), but for the names of other projects' objects hurraykv must use, each listed
with the reason.  Used by ``tests/docs/test_structure.py`` and ``tests/net``."""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"

# Private names of other projects' objects hurraykv has to use, and why.
FOREIGN = {
    "argparse._SubParsersAction",  # argparse's own type for add_subparsers' result
    "torch.ops._C",  # vLLM's compiled CPU ops live in torch.ops._C
    "os._exit",  # the documented way to end a forked child without cleanup
    "layer._quantized_keys", "layer._quantized_values",  # Transformers' QuantizedLayer
    "KVConnectorFactory._registry",  # vLLM's connector registry: registering twice
}
# Names other libraries publish with an underscore, on any object: namedtuple's methods
# (underscored so as not to clash with fields), enum's value map, argparse's actions.
FOREIGN_ATTRS = {"_make", "_replace", "_asdict", "_fields", "_value2member_map_",
                 "_actions"}


def modules(root: Path) -> dict[str, Path]:
    out = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports(root: Path) -> dict[str, set[str]]:
    """Each module's imports of the package's own modules, wherever they are written."""
    mods = modules(root)
    graph: dict[str, set[str]] = {name: set() for name in mods}
    for name, path in mods.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(package[:len(package) - node.level + 1]) if node.level \
                    else ""
                module = ".".join(p for p in (base, node.module or "") if p)
                subs = [f"{module}.{a.name}" for a in node.names
                        if f"{module}.{a.name}" in mods]
                found = subs + ([module] if len(subs) < len(node.names) else [])
            else:
                continue
            graph[name] |= {m for m in found if m in mods and m != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def private_reaches(root: Path) -> list[str]:
    """``path:line name`` of every private name a module uses but does not define."""
    out = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        own = set()
        for n in ast.walk(tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(n.name)
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                own.add(n.id)
            elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
                own.add(n.attr)
            elif isinstance(n, ast.arg):
                own.add(n.arg)
        for n in ast.walk(tree):
            if isinstance(n, ast.Attribute) and n.attr.startswith("_") \
                    and not n.attr.startswith("__") and n.attr not in own \
                    and n.attr not in FOREIGN_ATTRS:
                if isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"):
                    continue
                text = ast.unparse(n)
                if text not in FOREIGN:
                    out.append(f"{path.relative_to(root)}:{n.lineno} {text}")
            elif isinstance(n, ast.ImportFrom):
                out += [f"{path.relative_to(root)}:{n.lineno} from "
                        f"{'.' * n.level}{n.module or ''} import "
                        f"{a.name}" for a in n.names
                        if a.name.startswith("_") and not a.name.startswith("__")
                        and (n.level or (n.module or "").startswith("hurraykv"))
                        and not _module_named(root, n, a.name)]
    return out


def _module_named(root: Path, node: ast.ImportFrom, name: str) -> bool:
    """``from . import _kernels``: a private module of the package, not a reach."""
    return any(p.stem == name for p in root.rglob(f"{name}.py"))




def long_modules(root: Path, limit: int) -> dict[str, int]:
    """Each module of more than ``limit`` lines (its path under ``root``) and its length."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        lines = len(path.read_text().splitlines())
        if lines > limit:
            out[str(path.relative_to(root))] = lines
    return out


NAMES_END = 39  # the listing's first column (floor, names) ends here; the description follows


def floors(listing: str) -> dict[str, int]:
    """Each unit of ``docs/architecture.md``'s module listing (a package directory or a
    top-level module, by its name under ``hurraykv``) and its floor: a line ``floor N
    names`` starts floor N, a line of names indented 9 spaces adds to it."""
    out: dict[str, int] = {}
    floor = None
    for line in listing.splitlines():
        head = line[:NAMES_END]
        m = re.match(r"floor (\d+)\s+(\S.*)", head)
        if m:
            floor, names = int(m[1]), m[2]
        elif re.match(r" {9}\S", head) and floor is not None:
            names = head
        else:
            continue
        for name in re.split(r"[,\s]+", names.strip()):
            if name.endswith("/") or name.endswith(".py"):
                out[name.removesuffix("/").removesuffix(".py")] = floor
    return out


def floor_violations(graph: dict[str, set[str]], floor_of: dict[str, int], root: Path
                     ) -> list[str]:
    """The imports that go up a floor, or across to another package of the importer's
    floor (a package may import a single module of its floor, and a module any of its
    floor); and the modules of no unit the listing names."""
    package = next(p.name for p in root.iterdir() if (p / "__init__.py").exists())

    def unit(module: str) -> str | None:
        parts = module.split(".")
        return parts[1] if len(parts) > 1 else None

    bad = [f"{m}: in no floor of the listing" for m in sorted(graph)
           if unit(m) is not None and unit(m) not in floor_of]
    for a in sorted(graph):
        for b in sorted(graph[a]):
            ua, ub = unit(a), unit(b)
            if None in (ua, ub) or ua == ub or ua not in floor_of or ub not in floor_of:
                continue
            fa, fb = floor_of[ua], floor_of[ub]
            both_packages = (root / package / ua).is_dir() and (root / package / ub).is_dir()
            if fb > fa:
                bad.append(f"{a} (floor {fa}) imports {b} (floor {fb}): upward")
            elif fb == fa and both_packages:
                bad.append(f"{a} imports {b}: across floor {fa}, package to package")
    return bad
