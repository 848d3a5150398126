"""The import rules of architecture.json, checked on every module under gpuhook/ (DESIGN.md §(f)).

Each check returns every violation it finds, not the first, so a failure reads as a to-do list.
What counts as an import: `import a.b [as c]`, `from a import b` (b resolved to the submodule
a.b when gpuhook/a/b.py or gpuhook/a/b/__init__.py exists), relative imports resolved against the
importing module's package, and imports inside functions, classes, try blocks and under
`if TYPE_CHECKING:`. All of them are arrows for layering and the rules; module circles leave out
the TYPE_CHECKING ones, which never run and so cannot close a circle at import time, and leave
out the implicit import of a package's own __init__ by its submodules. The daemon's dynamic
preload (importlib.import_module over pkgutil) is invisible to this file; its own test covers it.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path, PurePosixPath
from typing import Any

import pytest

ROOT = Path(__file__).parents[2]
ARCHITECTURE = ROOT / "architecture.json"
PACKAGE = "gpuhook"


# --- the architecture file --------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Rule:
    """A forbidden import: importers (all modules when empty) minus except may not import forbid."""

    name: str
    importers: tuple[str, ...]
    exempt: tuple[str, ...]
    forbid: tuple[str, ...]
    why: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ArrowException:
    """One module allowed one import its part's arrows do not allow."""

    importer: str
    imports: str
    only_inside_functions: bool
    why: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Architecture:
    """architecture.json, decoded."""

    parts: dict[str, tuple[str, ...]]
    arrows: dict[str, tuple[str, ...]]
    exceptions: tuple[ArrowException, ...]
    rules: tuple[Rule, ...]
    hot_path: tuple[str, ...]
    hot_forbid: tuple[str, ...]
    transitional: dict[str, str]
    outside_any_part: tuple[str, ...]


def decode_architecture(raw: dict[str, Any]) -> Architecture:
    """The typed form of the JSON object (KeyError names a missing key)."""
    return Architecture(
        parts={name: tuple(part["members"]) for name, part in raw["parts"].items()},
        arrows={name: tuple(targets) for name, targets in raw["arrows"].items()},
        exceptions=tuple(ArrowException(importer=e["importer"], imports=e["imports"],
                                        only_inside_functions=bool(e.get("only_inside_functions", False)),
                                        why=e["why"]) for e in raw.get("arrow_exceptions", ())),
        rules=tuple(Rule(name=r["name"], importers=tuple(r.get("importers", ())), exempt=tuple(r.get("except", ())),
                         forbid=tuple(r["forbid"]), why=r["why"]) for r in raw["rules"]),
        hot_path=tuple(raw["hot_path"]["modules"]),
        hot_forbid=tuple(raw["hot_path"]["forbid_at_import"]),
        transitional=dict(raw.get("transitional", {})),
        outside_any_part=tuple(raw["outside_any_part"]),
    )


def load_architecture(path: Path = ARCHITECTURE) -> Architecture:
    """The project's architecture file."""
    return decode_architecture(json.loads(path.read_text()))


def covers(member: str, path: str) -> bool:
    """Whether a member ('dir/' or 'file.py') covers a repository path."""
    return path.startswith(member) if member.endswith("/") else path == member


def parts_of(arch: Architecture, path: str) -> list[str]:
    """The parts whose members cover path (one, when the file is consistent)."""
    return [name for name, members in arch.parts.items() if any(covers(m, path) for m in members)]


def matches(name: str, prefix: str) -> bool:
    """Whether a dotted module name is prefix or one of its submodules."""
    return name == prefix or name.startswith(prefix + ".")


def guessed_path(module: str) -> str:
    """Where a module that may not exist yet would live (enough to find its part)."""
    return module.replace(".", "/") + ".py"


def selects(arch: Architecture, selector: str, path: str) -> bool:
    """A rule's selector: a part name, or a member-style path."""
    if "/" in selector:
        return covers(selector, path)
    return selector in parts_of(arch, path)


def _check_members(arch: Architecture) -> list[str]:
    """Members are package paths, and no two cover the same module."""
    out = []
    members = [(m, name) for name, ms in arch.parts.items() for m in ms]
    members += [(m, "transitional") for m in arch.transitional]
    for member, owner in members:
        if not member.startswith(PACKAGE + "/") or not member.endswith(("/", ".py")):
            out.append(f"member {member!r} of {owner} is not 'gpuhook/<dir>/' or 'gpuhook/<file>.py'")
    for i, (a, owner_a) in enumerate(members):
        for b, owner_b in members[i + 1:]:
            if covers(a, b) or covers(b, a) or a == b:
                out.append(f"members overlap: {a!r} ({owner_a}) and {b!r} ({owner_b}); a module must have one part")
    return out


def _check_arrows(arch: Architecture) -> list[str]:
    """Arrows name known parts (or modules inside parts) and form a DAG."""
    out = []
    if set(arch.arrows) != set(arch.parts):
        out.append(f"arrows name parts {sorted(arch.arrows)} but parts are {sorted(arch.parts)}: "
                   f"give every part exactly one arrows entry ([] when it imports nothing)")
    for part, targets in arch.arrows.items():
        for target in targets:
            if "." in target:
                if not parts_of(arch, guessed_path(target)):
                    out.append(f"arrow {part} -> {target}: that module lies in no part")
            elif target not in arch.parts:
                out.append(f"arrow {part} -> {target}: no part named {target!r} (parts: {sorted(arch.parts)})")
    graph = {part: {_target_part(arch, t) for t in targets} - {part} for part, targets in arch.arrows.items()}
    for component in strongly_connected(graph):
        if len(component) > 1:
            cycle = shortest_cycle(graph, component)
            out.append(f"the allowed arrows form a circle: {' -> '.join(cycle)}; parts must form a DAG")
    return out


def _check_references(arch: Architecture) -> list[str]:
    """Rules, exceptions and the hot path name parts or paths inside parts."""
    out = []
    for rule in arch.rules:
        for selector in rule.importers + rule.exempt:
            if "/" not in selector and selector not in arch.parts:
                out.append(f"rule {rule.name}: selector {selector!r} is neither a path nor a part")
    for exc in arch.exceptions:
        if not parts_of(arch, exc.importer):
            out.append(f"arrow exception for {exc.importer}: that module lies in no part")
    for path in arch.hot_path:
        if not parts_of(arch, path):
            out.append(f"hot_path module {path} lies in no part")
    if arch.outside_any_part:
        out.append(f"outside_any_part must stay empty, got {list(arch.outside_any_part)}: give each a part")
    return out


def check_architecture(arch: Architecture) -> list[str]:
    """The file's own consistency: known parts, valid and disjoint members, a DAG of arrows."""
    return _check_members(arch) + _check_arrows(arch) + _check_references(arch)


def _target_part(arch: Architecture, target: str) -> str:
    """The part an arrow's target names (a part, or the part of a module)."""
    if "." not in target:
        return target
    found = parts_of(arch, guessed_path(target))
    return found[0] if found else target


# --- the source -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Import:
    """One import statement's arrow to one module."""

    importer: str  # dotted name of the importing module
    path: str  # its repository path
    line: int
    target: str  # absolute dotted name; for gpuhook, the module the name resolves to
    in_function: bool
    type_checking: bool

    @property
    def where(self) -> str:
        """Where in the file, for messages."""
        if self.type_checking:
            return " (under TYPE_CHECKING)"
        return " (inside a function)" if self.in_function else ""

    @property
    def at_import_time(self) -> bool:
        """Whether it runs when the importing module is imported."""
        return not (self.in_function or self.type_checking)


@dataclass(frozen=True, slots=True, kw_only=True)
class Tree:
    """The modules under gpuhook/ and every import in them."""

    modules: dict[str, str]  # dotted name -> repository path
    imports: tuple[Import, ...]


def module_name(path: PurePosixPath) -> str:
    """gpuhook/a/b.py -> gpuhook.a.b; gpuhook/a/__init__.py -> gpuhook.a."""
    parts = path.with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    """`if TYPE_CHECKING:` or `if typing.TYPE_CHECKING:`."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk(nodes: Iterable[ast.AST], *, in_function: bool, type_checking: bool) -> Iterator[tuple[ast.stmt, bool, bool]]:
    """Every import statement in or below nodes, with whether it sits in a function or under TYPE_CHECKING."""
    for node in nodes:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node, in_function, type_checking
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _walk(node.body, in_function=in_function, type_checking=True)
            yield from _walk(node.orelse, in_function=in_function, type_checking=type_checking)
        else:
            inner = in_function or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            yield from _walk(ast.iter_child_nodes(node), in_function=inner, type_checking=type_checking)


def _targets(stmt: ast.stmt, *, module: str, is_package: bool, modules: dict[str, str]) -> list[str]:
    """The absolute modules one import statement names."""
    if isinstance(stmt, ast.Import):
        return [alias.name for alias in stmt.names]
    assert isinstance(stmt, ast.ImportFrom)
    base = stmt.module or ""
    if stmt.level:
        package = module.split(".") if is_package else module.split(".")[:-1]
        if stmt.level > len(package):
            return [f"<relative import beyond the top package: level {stmt.level}>"]
        anchor = package[: len(package) - (stmt.level - 1)]
        base = ".".join(anchor + ([stmt.module] if stmt.module else []))
    if not matches(base, PACKAGE):
        return [base]
    # `from gpuhook import linux` imports the module gpuhook.linux, not a name of gpuhook/__init__.py
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in stmt.names]


def scan(root: Path) -> Tree:
    """Every module under root/gpuhook and what it imports."""
    files = sorted((root / PACKAGE).rglob("*.py"))
    modules = {module_name(PurePosixPath(f.relative_to(root).as_posix())): f.relative_to(root).as_posix()
               for f in files}
    imports = []
    for module, path in modules.items():
        tree = ast.parse((root / path).read_text(), filename=path)
        is_package = path.endswith("/__init__.py")
        for stmt, in_function, type_checking in _walk([tree], in_function=False, type_checking=False):
            for target in dict.fromkeys(_targets(stmt, module=module, is_package=is_package, modules=modules)):
                imports.append(Import(importer=module, path=path, line=stmt.lineno, target=target,
                                      in_function=in_function, type_checking=type_checking))
    return Tree(modules=modules, imports=tuple(imports))


def _path_of(tree: Tree, module: str) -> str:
    """A module's path, or where it would be."""
    return tree.modules.get(module, guessed_path(module))


# --- the checks -------------------------------------------------------------------------------


def check_membership(arch: Architecture, tree: Tree) -> list[str]:
    """Every module belongs to exactly one part; transitional modules are reported until deleted."""
    out = []
    for module, path in tree.modules.items():
        owners = parts_of(arch, path)
        note = arch.transitional.get(path)
        if note is not None:
            out.append(f"{path} ({module}): transitional module still present: {note}")
        elif not owners:
            out.append(f"{path} ({module}) belongs to no part: add it to a part's members in architecture.json, "
                       f"or move it into one")
        elif len(owners) > 1:
            out.append(f"{path} ({module}) belongs to parts {owners}: members must not overlap")
    return out


def _rule_applies(arch: Architecture, rule: Rule, imp: Import) -> bool:
    """Whether an import breaks a rule."""
    if not any(matches(imp.target, f) for f in rule.forbid):
        return False
    if rule.importers and not any(selects(arch, s, imp.path) for s in rule.importers):
        return False
    return not any(selects(arch, s, imp.path) for s in rule.exempt)


def _arrow_allowed(arch: Architecture, part: str, target_part: str, imp: Import) -> bool:
    """Whether the arrows (or an exception) let part import imp.target."""
    if part == target_part:
        return True
    for allowed in arch.arrows.get(part, ()):
        if ("." in allowed and matches(imp.target, allowed)) or allowed == target_part:
            return True
    return any(covers(e.importer, imp.path) and matches(imp.target, e.imports)
               and (imp.in_function or not e.only_inside_functions) for e in arch.exceptions)


def check_imports(arch: Architecture, tree: Tree) -> list[str]:
    """Every import keeps the rules and follows an allowed arrow; a broken rule is reported instead."""
    out = []
    for imp in tree.imports:
        if imp.path in arch.transitional:  # check_membership reports the module itself: it is to go
            continue
        head = f"{imp.path}:{imp.line} imports {imp.target}{imp.where}"
        broken = [r for r in arch.rules if _rule_applies(arch, r, imp)]
        out += [f"{head}: breaks rule {r.name}: {r.why}" for r in broken]
        if broken or not matches(imp.target, PACKAGE):
            continue
        target_path = _path_of(tree, imp.target)
        if imp.target not in tree.modules:
            out.append(f"{head}, which does not exist under {PACKAGE}/: create it, or import the name's new home")
            continue
        if target_path in arch.transitional:
            out.append(f"{head}: {imp.target} is transitional ({arch.transitional[target_path]})")
            continue
        mine, theirs = parts_of(arch, imp.path), parts_of(arch, target_path)
        if len(mine) != 1 or len(theirs) != 1:
            if len(mine) == 1:  # the importer's own part problem is check_membership's
                out.append(f"{head}: {target_path} belongs to no part in architecture.json")
            continue
        if not _arrow_allowed(arch, mine[0], theirs[0], imp):
            may = ", ".join(arch.arrows.get(mine[0], ())) or "nothing"
            out.append(f"{head}: arrow {mine[0]} -> {theirs[0]} is not allowed ({mine[0]} may import: {may}); "
                       f"move the code to a part {mine[0]} may import, or change architecture.json")
    return out


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components, each sorted, in a stable order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def shortest_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A shortest circle through the component's first node, staying inside the component (first node repeated)."""
    start, inside = component[0], set(component)
    came_from: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for succ in sorted(graph.get(node, set()) & inside):
            if succ == start:
                path = [node]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return [*reversed(path), start]
            if succ not in came_from:
                came_from[succ] = node
                queue.append(succ)
    return [start, start]  # unreachable for a component of two or more


def _edges(pairs: list[tuple[str, str, Import]]) -> tuple[dict[str, set[str]], dict[tuple[str, str], Import]]:
    """A graph from (from, to, witness) triples, self-loops dropped, first witness kept."""
    graph: dict[str, set[str]] = {}
    witness: dict[tuple[str, str], Import] = {}
    for a, b, imp in pairs:
        if a != b:
            graph.setdefault(a, set()).add(b)
            witness.setdefault((a, b), imp)
    return graph, witness


def _describe_cycles(graph: dict[str, set[str]], witness: dict[tuple[str, str], Import], what: str) -> list[str]:
    """One message per circle, each arrow with the import that makes it."""
    out = []
    for component in strongly_connected(graph):
        if len(component) < 2:
            continue
        cycle = shortest_cycle(graph, component)
        steps = "; ".join(f"{a} -> {b} by {witness[a, b].path}:{witness[a, b].line}" for a, b in pairwise(cycle))
        rest = f" (all tangled: {', '.join(component)})" if len(component) > len(cycle) - 1 else ""
        out.append(f"{what} form a circle {' -> '.join(cycle)}{rest}: {steps}")
    return out


def check_part_circles(arch: Architecture, tree: Tree) -> list[str]:
    """The parts the imports actually join form a DAG (TYPE_CHECKING imports count: they are arrows)."""
    pairs = []
    for imp in tree.imports:
        if imp.target in tree.modules:
            mine, theirs = parts_of(arch, imp.path), parts_of(arch, tree.modules[imp.target])
            if len(mine) == 1 and len(theirs) == 1:
                pairs.append((mine[0], theirs[0], imp))
    return _describe_cycles(*_edges(pairs), "parts")


def check_module_circles(tree: Tree) -> list[str]:
    """No circle of modules over the imports that run (module level or in functions)."""
    pairs = [(imp.importer, imp.target, imp) for imp in tree.imports
             if imp.target in tree.modules and not imp.type_checking]
    return _describe_cycles(*_edges(pairs), "modules")


def _parents(module: str) -> list[str]:
    """gpuhook.a.b -> [gpuhook, gpuhook.a]: the packages Python runs before the module."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def check_hot_path(arch: Architecture, tree: Tree) -> list[str]:
    """The hot-path modules, and what they import at import time (transitively), load nothing forbidden."""
    out = []
    by_importer: dict[str, list[Import]] = {}
    for imp in tree.imports:
        if imp.at_import_time:
            by_importer.setdefault(imp.importer, []).append(imp)
    for path in arch.hot_path:
        start = module_name(PurePosixPath(path))
        if start not in tree.modules:
            out.append(f"hot_path module {path} does not exist: create it, or drop it from architecture.json")
            continue
        # breadth first, so each message shows a shortest chain from the hot-path module
        came_from: dict[str, str | None] = {m: None for m in [*_parents(start), start]}
        queue = deque(came_from)
        while queue:
            module = queue.popleft()
            for imp in by_importer.get(module, ()):
                if any(matches(imp.target, f) for f in arch.hot_forbid):
                    chain = [module]
                    while (back := came_from[chain[-1]]) is not None:
                        chain.append(back)
                    via = " -> ".join(reversed(chain))
                    out.append(f"hot path {path} loads {imp.target} at import time: {via} -> {imp.target} "
                               f"({imp.path}:{imp.line}); import it inside the function that needs it")
                for nxt in [*_parents(imp.target), imp.target]:
                    if nxt in tree.modules and nxt not in came_from:
                        came_from[nxt] = module
                        queue.append(nxt)
    return out


# --- on the real tree ---------------------------------------------------------------------------


def _report(violations: list[str], what: str) -> None:
    """Fail listing every violation, one a line."""
    if violations:
        pytest.fail(f"{len(violations)} {what}:\n  " + "\n  ".join(violations), pytrace=False)


@pytest.fixture(scope="module")
def arch() -> Architecture:
    """architecture.json."""
    return load_architecture()


@pytest.fixture(scope="module")
def tree() -> Tree:
    """The package as it is on disk."""
    return scan(ROOT)


def test_architecture_file_is_consistent(arch: Architecture) -> None:
    """Every part an arrow names exists, members are disjoint, the allowed arrows form a DAG."""
    _report(check_architecture(arch), "inconsistencies in architecture.json")


def test_every_module_has_one_part(arch: Architecture, tree: Tree) -> None:
    """Every .py under gpuhook/ is a member of exactly one part, and no transitional one is left."""
    _report(check_membership(arch, tree), "modules outside the layout")


def test_imports_follow_the_arrows(arch: Architecture, tree: Tree) -> None:
    """Every import is an allowed arrow and breaks no rule."""
    _report(check_imports(arch, tree), "forbidden imports")


def test_parts_form_a_dag(arch: Architecture, tree: Tree) -> None:
    """The parts the imports join have no circle."""
    _report(check_part_circles(arch, tree), "circles between parts")


def test_modules_form_no_circle(tree: Tree) -> None:
    """No module reaches itself through imports that run."""
    _report(check_module_circles(tree), "circles between modules")


def test_hot_path_stays_light_on_the_source(arch: Architecture, tree: Tree) -> None:
    """The no-GPU path's modules import nothing heavy at import time, directly or through gpuhook modules."""
    _report(check_hot_path(arch, tree), "heavy imports on the hot path")


def test_no_gpu_path_imports_stay_light(arch: Architecture) -> None:
    """Importing the hot-path modules for real loads none of the forbidden modules the interpreter lacked."""
    present = [module_name(PurePosixPath(p)) for p in arch.hot_path if (ROOT / p).is_file()]
    assert present, "no hot_path module exists: architecture.json's hot_path lists the wrong files"
    code = ("import sys; before = set(sys.modules)\n"
            f"for name in {['gpuhook.cli', *present]!r}: __import__(name)\n"
            f"print(sorted(m for m in {list(arch.hot_forbid)!r} if m in set(sys.modules) - before))")
    out = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", f"importing {present} loads {out.stdout.strip()}"


# --- the checker on planted faults: proof that the tests above can fail ---------------------------


SYNTHETIC: dict[str, Any] = {
    "parts": {"base": {"members": ["gpuhook/__init__.py", "gpuhook/errors.py"], "why": "-"},
              "core": {"members": ["gpuhook/core/", "gpuhook/hot.py"], "why": "-"},
              "io": {"members": ["gpuhook/io/"], "why": "-"},
              "sysx": {"members": ["gpuhook/sysx/"], "why": "-"},
              "front": {"members": ["gpuhook/front/"], "why": "-"}},
    "arrows": {"base": [], "core": ["base"], "io": ["base", "core"], "sysx": [],
               "front": ["base", "core", "gpuhook.io.read"]},
    "rules": [{"name": "core-does-no-io", "importers": ["core"], "forbid": ["os"], "why": "core is pure"},
              {"name": "front-never-writes", "importers": ["gpuhook/front/"], "forbid": ["gpuhook.io.write"],
               "why": "fronts only read"}],
    "arrow_exceptions": [{"importer": "gpuhook/hot.py", "imports": "gpuhook.sysx.calls", "only_inside_functions": True,
                          "why": "-"}],
    "hot_path": {"modules": ["gpuhook/hot.py"], "forbid_at_import": ["yaml"], "why": "-"},
    "transitional": {"gpuhook/old.py": "moving to gpuhook/io/"},
    "outside_any_part": [],
}
CLEAN = {
    "gpuhook/__init__.py": "__version__ = '0'\n",
    "gpuhook/errors.py": "from gpuhook import __version__\n",
    "gpuhook/core/__init__.py": "",
    "gpuhook/core/a.py": "from . import b\nfrom gpuhook.errors import __version__\n",
    "gpuhook/core/b.py": ("TYPE_CHECKING = False\nif TYPE_CHECKING:\n    from gpuhook.core import a\n"
                          "def f():\n    from ..errors import __version__\n"),
    "gpuhook/hot.py": "from gpuhook.core import b\ndef g():\n    import yaml\n    from gpuhook.sysx import calls\n",
    "gpuhook/io/__init__.py": "",
    "gpuhook/io/read.py": "import os\nfrom gpuhook.core import a\n",
    "gpuhook/io/write.py": "import os\n",
    "gpuhook/sysx/__init__.py": "",
    "gpuhook/sysx/calls.py": "import os\n",
    "gpuhook/front/__init__.py": "from gpuhook.io import read\nimport gpuhook.io.read as r\n",
}


def _plant(root: Path, files: dict[str, str]) -> Tree:
    """Write a synthetic package under root and scan it."""
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return scan(root)


def _all(arch: Architecture, tree: Tree) -> list[str]:
    """Every check's violations together."""
    return (check_membership(arch, tree) + check_imports(arch, tree) + check_part_circles(arch, tree)
            + check_module_circles(tree) + check_hot_path(arch, tree))


def test_checker_passes_the_clean_tree(tmp_path: Path) -> None:
    """The planted tree without faults passes: relative, submodule and TYPE_CHECKING imports resolve right."""
    arch = decode_architecture(SYNTHETIC)
    tree = _plant(tmp_path, CLEAN)
    assert check_architecture(arch) == []
    assert _all(arch, tree) == []
    targets = {(i.importer, i.target) for i in tree.imports}
    assert {("gpuhook.core.a", "gpuhook.core.b"), ("gpuhook.core.b", "gpuhook.errors"),
            ("gpuhook.front", "gpuhook.io.read"), ("gpuhook.errors", "gpuhook")} <= targets


@pytest.mark.parametrize(("files", "expected"), [
    ({"gpuhook/core/c.py": "from gpuhook import io\nfrom gpuhook.io import write\n"},
     ["gpuhook/core/c.py:1 imports gpuhook.io: arrow core -> io is not allowed",
      "gpuhook/core/c.py:2 imports gpuhook.io.write: arrow core -> io"]),
    ({"gpuhook/front/x.py": "def f():\n    from gpuhook.io import write\n"},
     ["gpuhook/front/x.py:2 imports gpuhook.io.write (inside a function): breaks rule front-never-writes"]),
    ({"gpuhook/core/c.py": "TYPE_CHECKING = False\nif TYPE_CHECKING:\n    import os.path\n"},
     ["gpuhook/core/c.py:3 imports os.path (under TYPE_CHECKING): breaks rule core-does-no-io"]),
    ({"gpuhook/core/b.py": "def f():\n    from . import a\n"},
     ["modules form a circle gpuhook.core.a -> gpuhook.core.b -> gpuhook.core.a: gpuhook.core.a -> gpuhook.core.b "
      "by gpuhook/core/a.py:1; gpuhook.core.b -> gpuhook.core.a by gpuhook/core/b.py:2"]),
    ({"gpuhook/core/c.py": "from gpuhook.front import x\n", "gpuhook/front/x.py": ""},
     ["parts form a circle core -> front -> io -> core: core -> front by gpuhook/core/c.py:1",
      "gpuhook/core/c.py:1 imports gpuhook.front.x: arrow core -> front is not allowed"]),
    ({"gpuhook/hot.py": "from gpuhook.sysx import calls\n"},
     ["gpuhook/hot.py:1 imports gpuhook.sysx.calls: arrow core -> sysx is not allowed"]),
    ({"gpuhook/stray.py": ""}, ["gpuhook/stray.py (gpuhook.stray) belongs to no part"]),
    ({"gpuhook/old.py": "", "gpuhook/io/c.py": "from gpuhook import old\n"},
     ["gpuhook/old.py (gpuhook.old): transitional module still present: moving to gpuhook/io/",
      "gpuhook/io/c.py:1 imports gpuhook.old: gpuhook.old is transitional"]),
    ({"gpuhook/core/b.py": "from .gone import x\n"},
     ["gpuhook/core/b.py:1 imports gpuhook.core.gone, which does not exist"]),
    ({"gpuhook/core/b.py": "from gpuhook.io import read\n", "gpuhook/io/read.py": "import yaml\n"},
     ["hot path gpuhook/hot.py loads yaml at import time: gpuhook.hot -> gpuhook.core.b -> gpuhook.io.read -> yaml"]),
])
def test_checker_flags_planted_faults(tmp_path: Path, files: dict[str, str], expected: list[str]) -> None:
    """Each planted fault is reported, with the message a reader needs."""
    violations = _all(decode_architecture(SYNTHETIC), _plant(tmp_path, {**CLEAN, **files}))
    for text in expected:
        assert any(text in v for v in violations), f"{text!r} not in {violations}"


def test_checker_flags_an_inconsistent_file() -> None:
    """Unknown parts, overlapping members, circles of arrows and a non-empty outside list are caught."""
    raw = {**SYNTHETIC, "arrows": {**SYNTHETIC["arrows"], "base": ["front", "nowhere"]},
           "parts": {**SYNTHETIC["parts"], "front": {"members": ["gpuhook/front/", "gpuhook/core/a.py"], "why": "-"}},
           "outside_any_part": ["gpuhook/x.py"]}
    found = "\n".join(check_architecture(decode_architecture(raw)))
    for text in ("no part named 'nowhere'", "members overlap: 'gpuhook/core/' (core) and 'gpuhook/core/a.py' (front)",
                 "the allowed arrows form a circle", "outside_any_part must stay empty"):
        assert text in found, f"{text!r} not in {found}"
