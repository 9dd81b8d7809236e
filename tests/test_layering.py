"""The package's layering rules (docs/architecture.md), checked on the source.

Every ``.py`` under hmem/ is parsed with ``ast`` (the Cython kernels under
hmem/kernels/_native are read line by line for ``import``/``cimport``), the
module import graph is built from it, and each rule of docs/architecture.md
is one test below.  A failure names the offending file:line and the rule.

How imports are read:

- relative imports are resolved against the importing module's package;
- ``from hmem.store import lock`` imports the submodule hmem.store.lock,
  ``from hmem.store.store import Store`` imports hmem.store.store, and
  ``from hmem import Store`` imports the package ``hmem`` itself (its
  public names in hmem/__init__.py), while ``from hmem import errors``
  imports the submodule hmem.errors;
- importing a module does not count as importing its parent packages;
- imports inside ``if TYPE_CHECKING:`` are ignored (they never run), imports
  inside functions count;
- ``importlib.import_module("...")`` with a constant name counts; a name
  built at run time (hmem.kernels loads its kernel modules that way) is
  invisible to a static check.

The source checked is the checkout's hmem/ (next to tests/), whatever hmem
is installed: this is a static check of the code, not of the install.  The
self-tests at the end feed each checker a small synthetic source with a
violation, so that a checker that silently finds nothing fails too.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIR = ROOT / "hmem"

DOC = "docs/architecture.md"

# ---- the rules' data (docs/architecture.md) ------------------------------------

# Layer of each component.  A component is a folder of hmem/ (every module
# under it) or one top-level module.  hmem.__main__ (``python -m hmem``) is
# the command line's entry point and belongs to the CLI.
LAYERS: dict[str, int] = {
    "hmem.errors": 0,
    "hmem.validation": 0,
    "hmem._version": 0,
    "hmem.file_reads": 0,
    "hmem.threads": 0,
    "hmem.memory": 0,
    "hmem.config": 1,
    "hmem._io": 1,
    "hmem.object_store": 1,
    "hmem.kernels": 1,
    "hmem.formats": 2,
    "hmem.store": 3,
    "hmem.prefix_hit": 3,
    "hmem.recovery": 4,
    "hmem.transfer": 4,
    "hmem.lmcache": 4,
    "hmem": 5,
    "hmem.cli": 6,
}
COMPONENT_OF_MODULE = {"hmem.__main__": "hmem.cli"}
# Imports between two components of the same layer that the rules allow.
SAME_LAYER_ALLOWED = {("hmem.validation", "hmem.errors"), ("hmem.file_reads", "hmem.errors")}

KERNEL_LEAVES = ("hmem.kernels._native", "hmem.kernels.reference")
KERNELS_INIT_MAY_IMPORT = {"hmem.errors"}
PREFIX_HIT_MUST_NOT_IMPORT = ("hmem.store", "hmem.formats", "hmem.recovery", "hmem.transfer")
CLI = "hmem.cli"
PUBLIC_PACKAGES = ("hmem", "hmem.lmcache")  # the packages whose __init__ is the public API
CLI_ENTRY_POINTS = {"hmem.__main__"}
IO_MODULE_FILE = "hmem/_io.py"

RULE_KERNELS = (
    "hmem/kernels/_native/* and hmem/kernels/reference/* import nothing from hmem outside their own folder; "
    "hmem/kernels/__init__.py imports only hmem.errors"
)
RULE_LAYERS = "a module imports only from its own layer's folder or from lower layers"
RULE_PREFIX_HIT = "hmem/prefix_hit imports nothing from store, formats, recovery or transfer"
RULE_CLI_PUBLIC = (
    "the CLI imports only `hmem` and `hmem.lmcache` (the public names of their __init__.py) and hmem.cli.*"
)
RULE_NO_CLI = "the library never imports the CLI"
RULE_NO_CYCLES = "no import cycles between modules (imports under `if TYPE_CHECKING:` do not count)"
RULE_ONLY_IO_WRITES = "only hmem/_io.py writes, renames or deletes files"
RULE_STATE_OWNS_ITS_FIELDS = (
    "only hmem/store/state.py assigns a StoreState's attributes: its methods keep its invariants"
)
RULE_ENGINE_NEVER_IMPORTS_A_BACKEND = (
    "the store engine (hmem/store/*) never imports a storage backend: it talks to the Placement "
    "and ShardSource of hmem/store/placement.py; only hmem/store/opening.py chooses a backend"
)
# The object-storage backend: its client, its objects' format and its side of the seam.
BACKEND_MODULES = (
    "hmem.object_store",
    "hmem.formats.objects",
    "hmem.store.object_link",
    "hmem.store.object_fetch",
    "hmem.store.object_opening",
    "hmem.store.lease",
    "hmem.store.state_cache",
)
ENGINE = "hmem.store"
# Engine modules that may import a backend: opening chooses one from the location
# given, copying copies a store from one place to another.
BACKEND_CHOOSERS = {"hmem.store.opening", "hmem.store.copying"}
FACADE_MAX_LINES = 400
STATE_MODULE_FILE = "hmem/store/state.py"
# Assignments to a StoreState's attributes still made outside hmem/store/state.py, as
# {path: {attribute, ...}}: each is a state change to move into a StoreState method.
# Empty, and to stay so: add nothing here.
STATE_ASSIGNMENTS_ALLOWED: dict[str, set[str]] = {}


# ---- reading the source -----------------------------------------------------------


@dataclass(frozen=True)
class SourceFile:
    module: str  # dotted name: hmem.store.store, hmem.kernels._native._bitops
    path: str  # relative to the checkout, for messages
    text: str
    is_package: bool  # an __init__.py
    kind: str  # "py", or "pyx" for Cython sources (.pyx, .pxi)


@dataclass(frozen=True)
class Import:
    source: str  # importing module
    target: str  # imported module, dotted
    path: str
    line: int

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def load_sources(package_dir: Path = PACKAGE_DIR) -> list[SourceFile]:
    files = []
    for path in sorted(package_dir.rglob("*")):
        if not path.is_file() or "__pycache__" in path.parts:
            continue
        rel = path.relative_to(package_dir.parent)
        if path.suffix == ".py":
            kind = "py"
        elif path.suffix in (".pyx", ".pxi") and "_native" in rel.parts:
            kind = "pyx"
        else:
            continue
        parts = list(rel.with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        files.append(SourceFile(".".join(parts), rel.as_posix(), path.read_text(encoding="utf-8"), is_package, kind))
    return files


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_nodes(tree: ast.AST) -> Iterable[ast.AST]:
    """Every node of `tree` except those under an ``if TYPE_CHECKING:`` body."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            children: list[ast.AST] = [node.test, *node.orelse]
        else:
            children = list(ast.iter_child_nodes(node))
        stack.extend(reversed(children))


def _package_of(file: SourceFile) -> str:
    return file.module if file.is_package else file.module.rpartition(".")[0]


def _resolve_relative(file: SourceFile, level: int, name: str | None) -> str:
    base = _package_of(file)
    for _ in range(level - 1):
        base = base.rpartition(".")[0]
    return f"{base}.{name}" if name else base


def _py_imports(file: SourceFile, known: set[str]) -> list[Import]:
    tree = ast.parse(file.text, filename=file.path)
    found: list[Import] = []

    def add(target: str, node: ast.AST) -> None:
        found.append(Import(file.module, target, file.path, getattr(node, "lineno", 0)))

    for node in _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_relative(file, node.level, node.module) if node.level else (node.module or "")
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                add(sub if sub in known else base, node)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                add(node.args[0].value, node)
    return found


_PYX_IMPORT = re.compile(r"^\s*(?:from\s+(?P<base>[\w.]+)\s+c?import\s+(?P<names>.+)|c?import\s+(?P<mods>.+))$")


def _pyx_imports(file: SourceFile) -> list[Import]:
    """Cython is not Python: its import and cimport lines are read as text."""
    found = []
    for lineno, line in enumerate(file.text.splitlines(), 1):
        m = _PYX_IMPORT.match(line.split("#", 1)[0])
        if not m:
            continue
        if m["base"] is not None:
            base = m["base"]
            if base.startswith("."):
                level = len(base) - len(base.lstrip("."))
                base = _resolve_relative(file, level, base.lstrip(".") or None)
            targets = [base]
        else:
            targets = [part.split(" as ")[0].strip() for part in m["mods"].split(",")]
        for target in targets:
            found.append(Import(file.module, target, file.path, lineno))
    return found


def build_imports(files: Sequence[SourceFile]) -> list[Import]:
    known = {f.module for f in files}
    imports: dict[Import, None] = {}  # in order, once each (``from m import a, b`` is one import of m)
    for file in files:
        imports.update(dict.fromkeys(_py_imports(file, known) if file.kind == "py" else _pyx_imports(file)))
    return list(imports)


def _internal(name: str) -> bool:
    return name == "hmem" or name.startswith("hmem.")


def _inside(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


# ---- the checkers: each returns its violations, one line each ------------------------


def _violation(imp: Import, rule: str) -> str:
    return f"{imp.where}: {imp.source} imports {imp.target} -- rule: {rule} ({DOC})"


def check_kernels(imports: Iterable[Import]) -> list[str]:
    bad = []
    for imp in imports:
        if not _internal(imp.target):
            continue
        leaf = next((leaf for leaf in KERNEL_LEAVES if _inside(imp.source, leaf)), None)
        if leaf is not None:
            if not _inside(imp.target, leaf):  # a kernel set may share code among its own modules
                bad.append(_violation(imp, RULE_KERNELS))
        elif imp.source == "hmem.kernels" and imp.target not in KERNELS_INIT_MAY_IMPORT:
            bad.append(_violation(imp, RULE_KERNELS))
    return bad


def component(module: str) -> str | None:
    """The folder or top-level module that `module` belongs to, if it has a layer."""
    if module in COMPONENT_OF_MODULE:
        return COMPONENT_OF_MODULE[module]
    parts = module.split(".")
    candidate = ".".join(parts[:2])
    return candidate if candidate in LAYERS else None


def check_layers(imports: Iterable[Import]) -> list[str]:
    bad = []
    for imp in imports:
        if not _internal(imp.target):
            continue
        src, dst = component(imp.source), component(imp.target)
        if src is None or dst is None:
            unknown = imp.source if src is None else imp.target
            bad.append(
                f"{imp.where}: {unknown} belongs to no layer -- rule: every module of hmem has a "
                f"layer ({DOC}); add its folder there and to LAYERS in this test"
            )
            continue
        if src == dst or LAYERS[dst] < LAYERS[src] or (src, dst) in SAME_LAYER_ALLOWED:
            continue
        bad.append(_violation(imp, f"{RULE_LAYERS}; {src} is L{LAYERS[src]}, {dst} is L{LAYERS[dst]}"))
    return bad


def check_prefix_hit(imports: Iterable[Import]) -> list[str]:
    return [
        _violation(imp, RULE_PREFIX_HIT)
        for imp in imports
        if _inside(imp.source, "hmem.prefix_hit")
        and any(_inside(imp.target, banned) for banned in PREFIX_HIT_MUST_NOT_IMPORT)
    ]


def check_engine_never_imports_a_backend(imports: Iterable[Import]) -> list[str]:
    return [
        _violation(imp, RULE_ENGINE_NEVER_IMPORTS_A_BACKEND)
        for imp in imports
        if _inside(imp.source, ENGINE)
        and imp.source not in BACKEND_MODULES
        and imp.source not in BACKEND_CHOOSERS
        and any(_inside(imp.target, backend) for backend in BACKEND_MODULES)
    ]


def _is_cli(module: str) -> bool:
    return _inside(module, CLI) or module in CLI_ENTRY_POINTS


def check_cli_public_only(imports: Iterable[Import]) -> list[str]:
    return [
        _violation(imp, RULE_CLI_PUBLIC)
        for imp in imports
        if _is_cli(imp.source)
        and _internal(imp.target)
        and imp.target not in PUBLIC_PACKAGES
        and not _inside(imp.target, CLI)
    ]


def check_library_never_imports_cli(imports: Iterable[Import]) -> list[str]:
    return [_violation(imp, RULE_NO_CLI) for imp in imports if not _is_cli(imp.source) and _inside(imp.target, CLI)]


def check_no_cycles(imports: Iterable[Import]) -> list[str]:
    """One line per cycle: its edges in order, each with the file:line of the import."""
    edges: dict[str, dict[str, Import]] = {}
    for imp in imports:
        if _internal(imp.target) and imp.target != imp.source:
            edges.setdefault(imp.source, {}).setdefault(imp.target, imp)
    # Tarjan's strongly connected components, iteratively.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, {}))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, {})))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    scc = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        scc.append(member)
                        if member == node:
                            break
                    if len(scc) > 1:
                        components.append(sorted(scc))
    bad = []
    for scc in components:
        members = set(scc)
        # the shortest way back to the first member, through members only
        start = scc[0]
        previous: dict[str, str] = {}
        frontier = [start]
        while frontier and start not in previous:
            following = []
            for node in frontier:
                for child in sorted(edges.get(node, {})):
                    if child in members and child not in previous:
                        previous[child] = node
                        following.append(child)
            frontier = following
        path = [start]
        while True:
            path.append(previous[path[-1]])
            if path[-1] == start:
                break
        path.reverse()
        steps = [edges[a][b] for a, b in zip(path, path[1:])]
        shown = " -> ".join(f"{s.source} ({s.where})" for s in steps) + f" -> {start}"
        bad.append(f"cycle of {len(scc)} modules {scc}: {shown} -- rule: {RULE_NO_CYCLES} ({DOC})")
    return bad


# ---- "only hmem/_io.py writes" -------------------------------------------------------
#
# A static check cannot know what a call does, so it looks for the calls that
# write, rename, delete or fsync files, by name:
#
# - module functions, resolved through the module's imports (``import os as
#   _os``, ``from os import replace``): os.write/rename/replace/unlink/remove/
#   rmdir/truncate/ftruncate/makedirs/mkdir/fsync/... , os.open with a
#   writing flag (O_WRONLY, O_RDWR, O_CREAT, O_TRUNC, O_APPEND) or flags it
#   cannot read, shutil.rmtree/move/copy*, tempfile's file and directory
#   makers, numpy.save/savez/savetxt, numpy.memmap unless mode is "r" or
#   "c", mmap.mmap of a file unless access is ACCESS_READ or ACCESS_COPY
#   (mmap.mmap(-1, ...) maps memory, no file), torch.save,
#   and any ``save_file(...)`` (safetensors);
# - openers (builtin open, io.open, os.fdopen, gzip/bz2/lzma/codecs.open,
#   tarfile.open, zipfile.ZipFile, io.FileIO) whose mode is not a constant
#   without w, a, x or + (a mode computed at run time is flagged too), and
#   ``<path>.open(mode)`` with such a constant mode;
# - methods that only paths have, on any receiver: .write_bytes(,
#   .write_text(, .unlink(, .mkdir(, .rmdir(, .touch(, .symlink_to(,
#   .hardlink_to(, and numpy's .tofile(;
# - .rename( and .replace( only with exactly one positional argument and no
#   keyword: that is Path.rename(target) / Path.replace(target), while
#   str.replace and bytes.replace always take two arguments and
#   datetime.replace / namedtuple-style replaces take keywords;
# - a method call whose receiver is a name bound by an import (``_io.unlink``,
#   ``dataclasses.replace``) is a module function, judged by the first list
#   only: hmem._io's own functions are how everything else writes.

OS_WRITES = {
    "write",
    "pwrite",
    "writev",
    "pwritev",
    "rename",
    "renames",
    "replace",
    "unlink",
    "remove",
    "removedirs",
    "rmdir",
    "truncate",
    "ftruncate",
    "makedirs",
    "mkdir",
    "mkfifo",
    "mknod",
    "link",
    "symlink",
    "fsync",
    "fdatasync",
    "posix_fallocate",
    "copy_file_range",
    "sendfile",
}
OS_WRITE_FLAGS = {"O_WRONLY", "O_RDWR", "O_CREAT", "O_TRUNC", "O_APPEND"}
# tempfile.TemporaryDirectory is allowed: a private scratch directory that
# tempfile itself creates and removes holds no store's or user's file (the
# demo runs in one); docs/architecture.md states this exception.
TEMPFILE_MAKERS = {"mkstemp", "mkdtemp", "NamedTemporaryFile", "TemporaryFile", "SpooledTemporaryFile"}
NUMPY_WRITES = {"save", "savez", "savez_compressed", "savetxt"}
OPENERS = {
    "open",
    "io.open",
    "os.fdopen",
    "gzip.open",
    "bz2.open",
    "lzma.open",
    "codecs.open",
    "tarfile.open",
    "zipfile.ZipFile",
    "io.FileIO",
}
PATH_ONLY_METHODS = {
    "write_bytes",
    "write_text",
    "unlink",
    "mkdir",
    "rmdir",
    "touch",
    "symlink_to",
    "hardlink_to",
    "tofile",
}
RENAMING_METHODS = {"rename", "replace"}


def _import_bindings(tree: ast.AST) -> dict[str, str]:
    """Local name -> the dotted name it stands for, from every import of the module."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    names[alias.asname] = alias.name
                else:
                    root = alias.name.split(".")[0]
                    names[root] = root
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            for alias in node.names:
                names[alias.asname or alias.name] = f"{base}.{alias.name}" if base else alias.name
    return names


def _dotted(expr: ast.expr, bindings: dict[str, str]) -> str | None:
    if isinstance(expr, ast.Name):
        return bindings.get(expr.id, expr.id)
    if isinstance(expr, ast.Attribute):
        inner = _dotted(expr.value, bindings)
        return f"{inner}.{expr.attr}" if inner else None
    return None


def _root_name(expr: ast.expr) -> str | None:
    while isinstance(expr, ast.Attribute):
        expr = expr.value
    return expr.id if isinstance(expr, ast.Name) else None


def _argument(call: ast.Call, position: int, keyword: str) -> ast.expr | None:
    for kw in call.keywords:
        if kw.arg == keyword:
            return kw.value
    return call.args[position] if len(call.args) > position else None


def _writing_mode(mode: ast.expr | None) -> str | None:
    """Why `mode` may write: None when it is absent or a constant that only reads."""
    if mode is None:
        return None
    if isinstance(mode, ast.Constant) and isinstance(mode.value, str):
        return f"mode {mode.value!r}" if set(mode.value) & set("wax+") else None
    return "a mode computed at run time"


def _names_in(expr: ast.expr) -> set[str]:
    names = set()
    for node in ast.walk(expr):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
    return names


def _write_reason(call: ast.Call, bindings: dict[str, str]) -> str | None:
    func = call.func
    name = _dotted(func, bindings)
    if name is not None:
        module, _, attr = name.rpartition(".")
        if module == "os" and attr in OS_WRITES:
            return f"{name}()"
        if name == "os.open":
            flags = _argument(call, 1, "flags")
            used = _names_in(flags) if flags is not None else set()
            if used & OS_WRITE_FLAGS:
                return "os.open() with writing flags"
            if "O_RDONLY" not in used:
                return "os.open() with flags a static check cannot read"
            return None
        if module == "shutil" and (attr in ("rmtree", "move") or attr.startswith("copy")):
            return f"{name}()"
        if module == "tempfile" and attr in TEMPFILE_MAKERS:
            return f"{name}() (creates and deletes files)"
        if module == "numpy" and attr in NUMPY_WRITES:
            return f"{name}()"
        if name == "numpy.memmap":
            mode = _argument(call, 2, "mode")
            if not (isinstance(mode, ast.Constant) and mode.value in ("r", "readonly", "c", "copyonwrite")):
                return "numpy.memmap() that may write"
        if name == "mmap.mmap":
            access = _argument(call, 3, "access")
            fileno = _argument(call, 0, "fileno")
            anonymous = (
                isinstance(fileno, ast.UnaryOp)
                and isinstance(fileno.op, ast.USub)
                and isinstance(fileno.operand, ast.Constant)
                and fileno.operand.value == 1
            )
            if not anonymous and not (
                isinstance(access, ast.Attribute) and access.attr in ("ACCESS_READ", "ACCESS_COPY")
            ):
                return "mmap.mmap() that may write"
        if name == "torch.save" or attr == "save_file" or name == "save_file":
            return f"{name}()"
        if name in OPENERS:
            why = _writing_mode(_argument(call, 1, "mode"))
            return f"{name}() with {why}" if why else None
    if not isinstance(func, ast.Attribute):
        return None
    root = _root_name(func.value)
    if root is not None and root in bindings:
        return None  # a module's function: judged above by its dotted name
    method = func.attr
    if method in PATH_ONLY_METHODS:
        return f".{method}()"
    if method in RENAMING_METHODS and len(call.args) == 1 and not call.keywords:
        return f".{method}(target) (a path rename)"
    if method == "open":
        why = _writing_mode(_argument(call, 0, "mode"))
        if why and why != "a mode computed at run time":
            return f".open() with {why}"
    return None


def file_writes(file: SourceFile) -> list[str]:
    """The writing calls of one Python file, as "path:line: what" lines."""
    tree = ast.parse(file.text, filename=file.path)
    bindings = _import_bindings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            why = _write_reason(node, bindings)
            if why:
                found.append(f"{file.path}:{node.lineno}: {why} -- rule: {RULE_ONLY_IO_WRITES} ({DOC})")
    return found


def check_only_io_writes(files: Iterable[SourceFile]) -> list[str]:
    bad = []
    for file in files:
        if file.kind == "py" and file.path != IO_MODULE_FILE:
            bad.extend(file_writes(file))
    return bad


# ---- StoreState's attributes are assigned by its own methods only ----------------------


def state_attributes(text: str) -> set[str]:
    """The attributes class StoreState (in `text`, hmem/store/state.py)
    assigns through ``self``, in any of its methods, and its properties."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef) and node.name == "StoreState":
            for inner in ast.walk(node):
                if isinstance(inner, ast.FunctionDef) and any(
                    isinstance(d, ast.Name) and d.id == "property" for d in inner.decorator_list
                ):
                    names.add(inner.name)
                for target in _assigned(inner):
                    if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name):
                        if target.value.id == "self":
                            names.add(target.attr)
    return names


def _assigned(node: ast.AST) -> list[ast.expr]:
    """The targets `node` assigns (=, augmented, annotated), tuples and
    starred targets taken apart."""
    if isinstance(node, ast.Assign):
        pending = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        pending = [node.target]
    else:
        return []
    found = []
    while pending:
        target = pending.pop()
        if isinstance(target, (ast.Tuple, ast.List)):
            pending.extend(target.elts)
        elif isinstance(target, ast.Starred):
            pending.append(target.value)
        else:
            found.append(target)
    return found


def _is_a_state(expr: ast.expr) -> bool:
    """Whether `expr` names a StoreState the way hmem does: ``state``,
    ``self.state``, ``self._state``, ``opened.state``."""
    name = expr.id if isinstance(expr, ast.Name) else expr.attr if isinstance(expr, ast.Attribute) else None
    return name in ("state", "_state")


def state_assignments(file: SourceFile, attributes: set[str]) -> list[str]:
    """The assignments of a StoreState's `attributes` in one Python file, as
    "path:line: target" lines (an attribute of an object the state holds,
    ``state.cache.capacity``, is that object's own)."""
    allowed = STATE_ASSIGNMENTS_ALLOWED.get(file.path, set())
    found = []
    for node in ast.walk(ast.parse(file.text, filename=file.path)):
        for target in _assigned(node):
            if (
                isinstance(target, ast.Attribute)
                and target.attr in attributes
                and target.attr not in allowed
                and _is_a_state(target.value)
            ):
                found.append(
                    f"{file.path}:{target.lineno}: assigns {ast.unparse(target)} "
                    f"-- rule: {RULE_STATE_OWNS_ITS_FIELDS} ({DOC})"
                )
    return found


def check_state_owns_its_fields(files: Iterable[SourceFile], attributes: set[str]) -> list[str]:
    bad = []
    for file in files:
        if file.kind == "py" and file.path != STATE_MODULE_FILE:
            bad.extend(state_assignments(file, attributes))
    return bad


# ---- the rules, on the real package ----------------------------------------------------


@pytest.fixture(scope="module")
def sources() -> list[SourceFile]:
    files = load_sources()
    assert files, f"no source found under {PACKAGE_DIR}"
    return files


@pytest.fixture(scope="module")
def imports(sources) -> list[Import]:
    return build_imports(sources)


def _report(violations: list[str], rule: str) -> str:
    return f"{len(violations)} violation(s) of: {rule}\n" + "\n".join(violations)


def test_the_graph_is_read(sources, imports):
    """The walker sees the package: a vacuous graph would pass every rule."""
    modules = {f.module for f in sources}
    assert {"hmem", "hmem.errors", "hmem._io", "hmem.store.store", "hmem.cli.app"} <= modules
    assert any(f.kind == "pyx" for f in sources), "the Cython kernels were not read"
    edges = {(i.source, i.target) for i in imports}
    assert ("hmem.validation", "hmem.errors") in edges
    assert ("hmem", "hmem.store.store") in edges


def test_kernels_import_nothing_from_hmem(imports):
    bad = check_kernels(imports)
    assert not bad, _report(bad, RULE_KERNELS)


def test_modules_import_only_their_own_folder_or_lower_layers(imports):
    bad = check_layers(imports)
    assert not bad, _report(bad, RULE_LAYERS)


def test_prefix_hit_is_independent_of_the_store(imports):
    bad = check_prefix_hit(imports)
    assert not bad, _report(bad, RULE_PREFIX_HIT)


def test_the_engine_never_imports_a_backend(imports):
    bad = check_engine_never_imports_a_backend(imports)
    assert not bad, _report(bad, RULE_ENGINE_NEVER_IMPORTS_A_BACKEND)
    # the rule is not vacuous: the backend modules exist, and the chooser does import one
    edges = {(i.source, i.target) for i in imports}
    assert ("hmem.store.opening", "hmem.store.object_opening") in edges


def test_the_facade_stays_a_facade(sources):
    """docs/architecture.md, rule 10: the Store facade checks, locks and
    delegates; what it grows goes to the component that owns it."""
    [facade] = [f for f in sources if f.path == "hmem/store/store.py"]
    lines = facade.text.count("\n")
    assert lines <= FACADE_MAX_LINES, f"hmem/store/store.py is {lines} lines, the rule is at most {FACADE_MAX_LINES}"


def test_the_cli_uses_only_the_public_api(imports):
    bad = check_cli_public_only(imports)
    assert not bad, _report(bad, RULE_CLI_PUBLIC)


def test_the_library_never_imports_the_cli(imports):
    bad = check_library_never_imports_cli(imports)
    assert not bad, _report(bad, RULE_NO_CLI)


def test_no_import_cycles(imports):
    bad = check_no_cycles(imports)
    assert not bad, _report(bad, RULE_NO_CYCLES)


def test_only_io_writes_files(sources):
    bad = check_only_io_writes(sources)
    assert not bad, _report(bad, RULE_ONLY_IO_WRITES)


def test_only_the_state_assigns_its_attributes(sources):
    [state_file] = [f for f in sources if f.path == STATE_MODULE_FILE]
    attributes = state_attributes(state_file.text)
    # the walker sees the class: an empty set would pass every module
    assert {"committed", "shards", "n", "next_id", "builder", "dirty", "limits", "read_only"} <= attributes
    bad = check_state_owns_its_fields(sources, attributes)
    assert not bad, _report(bad, RULE_STATE_OWNS_ITS_FIELDS)


# ---- self-tests: each checker catches a violation ----------------------------------------


def _synthetic(modules: dict[str, str], packages: Iterable[str] = ()) -> list[SourceFile]:
    """Source files from {module: source}; a module named in `packages` is an __init__."""
    packages = set(packages)
    files = []
    for module, text in modules.items():
        is_package = module in packages
        path = module.replace(".", "/") + ("/__init__.py" if is_package else ".py")
        kind = "py"
        if module.startswith("hmem.kernels._native._"):
            kind, path = "pyx", module.replace(".", "/") + ".pyx"
        files.append(SourceFile(module, path, text, is_package, kind))
    return files


_BASE = {
    "hmem": "from hmem.store.store import Store\n",
    "hmem.errors": "",
    "hmem.validation": "from hmem.errors import InvalidArgumentError\n",
    "hmem._io": "import os\n",
    "hmem.config": "from hmem import validation\n",
    "hmem.kernels": "from hmem.errors import KernelUnavailableError\n",
    "hmem.kernels._native": "",
    "hmem.kernels.reference": "",
    "hmem.kernels.reference.bitops": "import numpy as np\n",
    "hmem.kernels._native._bitops": "from libc.stdint cimport uint8_t\nimport operator\n",
    "hmem.formats": "",
    "hmem.formats.manifest": "from hmem import _io\nfrom hmem.errors import CorruptStoreError\n",
    "hmem.store": "",
    "hmem.store.store": "from . import lock\nfrom ..formats.manifest import X\n",
    "hmem.store.lock": "from hmem._io import open_lock_file\n",
    "hmem.store.opening": "def f():\n    from hmem.store import object_link\n",
    "hmem.store.object_link": "from hmem.object_store import ObjectClient\n",
    "hmem.object_store": "",
    "hmem.prefix_hit": "",
    "hmem.prefix_hit.bitmap": "from hmem.kernels import bitops\n",
    "hmem.cli": "",
    "hmem.cli.app": "from hmem import Store\nfrom hmem.cli import output\n",
    "hmem.cli.output": "import rich\n",
}
_PACKAGES = {
    "hmem",
    "hmem.kernels",
    "hmem.kernels._native",
    "hmem.kernels.reference",
    "hmem.formats",
    "hmem.store",
    "hmem.prefix_hit",
    "hmem.cli",
}


def _imports_with(**changes: str) -> list[Import]:
    modules = dict(_BASE)
    modules.update({name.replace("__", "."): text for name, text in changes.items()})
    return build_imports(_synthetic(modules, _PACKAGES))


def test_self_the_clean_synthetic_package_passes_every_checker():
    imports = _imports_with()
    for check in (
        check_kernels,
        check_layers,
        check_prefix_hit,
        check_cli_public_only,
        check_library_never_imports_cli,
        check_no_cycles,
        check_engine_never_imports_a_backend,
    ):
        assert check(imports) == [], check.__name__
    edges = {(i.source, i.target) for i in imports}
    assert ("hmem.store.store", "hmem.store.lock") in edges  # from . import lock
    assert ("hmem.store.store", "hmem.formats.manifest") in edges  # from ..formats.manifest import X
    assert ("hmem.cli.app", "hmem") in edges and ("hmem.cli.app", "hmem.cli.output") in edges


def test_self_kernels_checker():
    bad = check_kernels(_imports_with(hmem__kernels__reference__bitops="from hmem.errors import HmemError\n"))
    assert len(bad) == 1 and bad[0].startswith("hmem/kernels/reference/bitops.py:1:") and RULE_KERNELS in bad[0]
    bad = check_kernels(
        _imports_with(
            hmem__kernels___native___bitops="from libc.stdint cimport uint8_t\nfrom hmem.kernels cimport helpers\n"
        )
    )
    assert len(bad) == 1 and bad[0].startswith("hmem/kernels/_native/_bitops.pyx:2:")
    bad = check_kernels(
        _imports_with(hmem__kernels__reference__bitops="from hmem.kernels.reference._paths import best_path\n")
    )
    assert bad == []  # a sibling in the same kernel set
    bad = check_kernels(_imports_with(hmem__kernels__reference__bitops="from hmem.kernels._native import _bitops\n"))
    assert len(bad) == 1 and "hmem.kernels._native" in bad[0]  # the other kernel set
    bad = check_kernels(_imports_with(hmem__kernels="from hmem.errors import E\nfrom hmem import config\n"))
    assert len(bad) == 1 and bad[0].startswith("hmem/kernels/__init__.py:2:") and "hmem.config" in bad[0]


def test_self_layers_checker():
    bad = check_layers(_imports_with(hmem__formats__manifest="from hmem.store.lock import StoreLock\n"))
    assert len(bad) == 1 and bad[0].startswith("hmem/formats/manifest.py:1:") and "L2" in bad[0] and "L3" in bad[0]
    # same layer, another folder
    bad = check_layers(_imports_with(hmem__store__lock="from hmem.prefix_hit.bitmap import Bitmap\n"))
    assert len(bad) == 1 and "hmem.prefix_hit" in bad[0]
    # L0: errors imports nothing from hmem
    bad = check_layers(_imports_with(hmem__errors="from hmem import validation\n"))
    assert len(bad) == 1 and bad[0].startswith("hmem/errors.py:1:")
    # the library importing the public package from below
    bad = check_layers(_imports_with(hmem__store__lock="import hmem\n"))
    assert len(bad) == 1 and "L5" in bad[0]
    # a module no layer covers
    bad = check_layers(_imports_with(hmem__store__lock="from hmem.newthing import X\n"))
    assert len(bad) == 1 and "belongs to no layer" in bad[0]


def test_self_type_checking_imports_are_ignored():
    text = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from hmem.store.store import Store\n"
    assert check_layers(_imports_with(hmem__formats__manifest=text)) == []
    text = "import typing\nif typing.TYPE_CHECKING:\n    pass\nelse:\n    from hmem.store import lock\n"
    assert len(check_layers(_imports_with(hmem__formats__manifest=text))) == 1  # the else branch runs
    text = "def f():\n    from hmem.store import lock\n"
    assert len(check_layers(_imports_with(hmem__formats__manifest=text))) == 1  # a lazy import counts


def test_self_prefix_hit_checker():
    bad = check_prefix_hit(_imports_with(hmem__prefix_hit__bitmap="from hmem.formats import manifest\n"))
    assert len(bad) == 1 and bad[0].startswith("hmem/prefix_hit/bitmap.py:1:") and RULE_PREFIX_HIT in bad[0]


def test_self_engine_backend_checker():
    text = "def f():\n    from hmem.store.object_link import ObjectLink\n"
    bad = check_engine_never_imports_a_backend(_imports_with(hmem__store__store=text))
    assert len(bad) == 1 and bad[0].startswith("hmem/store/store.py:2:")
    assert RULE_ENGINE_NEVER_IMPORTS_A_BACKEND in bad[0]
    bad = check_engine_never_imports_a_backend(_imports_with(hmem__store__state="from hmem import object_store\n"))
    assert len(bad) == 1 and "hmem.object_store" in bad[0]
    # the chooser and the backend's own modules may
    assert not check_engine_never_imports_a_backend(_imports_with(hmem__store__opening=text))
    assert not check_engine_never_imports_a_backend(_imports_with(hmem__store__object_opening=text))


def test_self_cli_checker():
    bad = check_cli_public_only(_imports_with(hmem__cli__app="from hmem import Store, errors\n"))
    assert len(bad) == 1 and bad[0].startswith("hmem/cli/app.py:1:") and "hmem.errors" in bad[0]
    bad = check_cli_public_only(_imports_with(hmem__cli__app="import hmem.store.store\n"))
    assert len(bad) == 1 and "hmem.store.store" in bad[0]
    bad = check_cli_public_only(_imports_with(hmem__cli__app="from ..formats import manifest\n"))
    assert len(bad) == 1 and "hmem.formats.manifest" in bad[0]


def test_self_library_never_imports_cli_checker():
    bad = check_library_never_imports_cli(_imports_with(hmem__store__lock="from hmem.cli.output import x\n"))
    assert len(bad) == 1 and bad[0].startswith("hmem/store/lock.py:1:") and RULE_NO_CLI in bad[0]
    bad = check_library_never_imports_cli(_imports_with(hmem="import importlib\nimportlib.import_module('hmem.cli')\n"))
    assert len(bad) == 1 and bad[0].startswith("hmem/__init__.py:2:")


def test_self_cycle_checker():
    imports = _imports_with(hmem__store__lock="from hmem.store import store\n")
    bad = check_no_cycles(imports)
    assert len(bad) == 1
    assert "hmem/store/store.py:1" in bad[0] and "hmem/store/lock.py:1" in bad[0] and RULE_NO_CYCLES in bad[0]
    # three modules, and the same cycle through TYPE_CHECKING is no cycle
    imports = _imports_with(
        hmem__store__lock="from hmem.formats.manifest import M\n",
        hmem__formats__manifest="from hmem.store.store import Store\n",
    )
    assert len(check_no_cycles(imports)) == 1 and "3 modules" in check_no_cycles(imports)[0]
    tc = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from hmem.store.store import Store\n"
    assert (
        check_no_cycles(
            _imports_with(hmem__store__lock="from hmem.formats.manifest import M\n", hmem__formats__manifest=tc)
        )
        == []
    )


@pytest.mark.parametrize(
    "line",
    [
        "os.replace(a, b)",
        "os.unlink(p)",
        "os.fsync(fd)",
        "os.makedirs(d, exist_ok=True)",
        "_os.rename(a, b)",
        "rm(p)",
        "os.open(p, os.O_WRONLY | os.O_CREAT)",
        "os.open(p, flags)",
        "shutil.rmtree(d)",
        "shutil.copy2(a, b)",
        "shutil.move(a, b)",
        "tempfile.mkstemp()",
        "np.save(p, x)",
        "np.savez(p, x=x)",
        "np.memmap(p, dtype='u1')",
        "x.tofile(p)",
        "mmap.mmap(fd, 0)",
        "save_file({'k': x}, p)",
        "st.save_file({'k': x}, p)",
        "open(p, 'w')",
        "open(p, mode='ab')",
        "open(p, 'r+b')",
        "open(p, mode)",
        "io.open(p, 'wb')",
        "os.fdopen(fd, 'w')",
        "zipfile.ZipFile(p, 'w')",
        "path.open('w')",
        "path.write_bytes(b'')",
        "(root / 'x').write_text('')",
        "self.path.unlink(missing_ok=True)",
        "Path(p).mkdir(parents=True)",
        "p.touch()",
        "p.rmdir()",
        "tmp.rename(final)",
        "tmp.replace(final)",
        "(d / 'a').replace(d / 'b')",
    ],
)
def test_self_write_checker_flags(line):
    header = (
        "import os\nimport os as _os\nimport shutil, tempfile, io, mmap, zipfile\nimport numpy as np\n"
        "from os import remove as rm\nfrom safetensors.numpy import save_file\nimport safetensors.numpy as st\n"
        "from pathlib import Path\n"
    )
    [file] = _synthetic({"hmem.store.thing": header + line + "\n"})
    bad = check_only_io_writes([file])
    assert len(bad) == 1, bad
    assert bad[0].startswith("hmem/store/thing.py:9:") and RULE_ONLY_IO_WRITES in bad[0]


@pytest.mark.parametrize(
    "line",
    [
        "text.replace(' ', '')",
        "name.replace('a', 'b', 1)",
        "when.replace(tzinfo=None)",
        "dataclasses.replace(info)",
        "dataclasses.replace(mf, generation=2)",
        "_io.unlink(p)",
        "_io.rename(a, b)",
        "_io.write_file(p, parts)",
        "open(p)",
        "open(p, 'rb')",
        "open(p, mode='r')",
        "Store.open(store, read_only=True)",
        "path.open()",
        "path.read_bytes()",
        "os.open(p, os.O_RDONLY | os.O_CLOEXEC)",
        "os.path.exists(p)",
        "os.fspath(p)",
        "mmap.mmap(fd, n, access=mmap.ACCESS_READ)",
        "mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)",
        "np.memmap(p, dtype='u1', mode='r')",
        "np.frombuffer(b, np.uint8)",
        "series.rename(columns={})",
    ],
)
def test_self_write_checker_passes(line):
    header = "import os, mmap, dataclasses\nimport numpy as np\nfrom hmem import _io\nfrom hmem import Store\n"
    [file] = _synthetic({"hmem.store.thing": header + line + "\n"})
    assert check_only_io_writes([file]) == []


def test_self_write_checker_spares_io_itself():
    [io_file] = _synthetic({"hmem._io": "import os\nos.replace(a, b)\nos.fsync(fd)\n"})
    assert io_file.path == IO_MODULE_FILE
    assert check_only_io_writes([io_file]) == []


_STATE_SOURCE = """
class StoreState:
    def __init__(self):
        self.n = 0
        self.committed, self.shards = None, []
        self.dirty: set = set()

    @property
    def read_only(self):
        return False

class Other:
    def __init__(self):
        self.ids = None
"""


def test_self_state_attributes_are_read_from_the_class():
    assert state_attributes(_STATE_SOURCE) == {"n", "committed", "shards", "dirty", "read_only"}


@pytest.mark.parametrize(
    "line",
    [
        "state.n = 1",
        "self.state.committed = mf",
        "self._state.shards = []",
        "opened.state.dirty = set()",
        "state.dirty |= taken",
        "state.n: int = 2",
        "state.n, state.next = 1, 2",
        "a, (b, state.shards) = x",
        "first, *state.shards = x",
    ],
)
def test_self_state_checker_flags(line):
    [file] = _synthetic({"hmem.store.thing": "x = 1\n" + line + "\n"})
    bad = check_state_owns_its_fields([file], state_attributes(_STATE_SOURCE))
    assert len(bad) == 1, bad
    assert bad[0].startswith("hmem/store/thing.py:2:") and RULE_STATE_OWNS_ITS_FIELDS in bad[0]


@pytest.mark.parametrize(
    "line",
    [
        "state.cache.fetcher = f",  # the cache's own attribute
        "self.state.ids = ids",  # not a StoreState attribute (a shard reader's state)
        "self.n = 1",
        "state.records['shard_idx'][victims] = 0",
        "n = state.n",
        "mf.shards = []",
        "state.commit(mf)",
    ],
)
def test_self_state_checker_passes(line):
    [file] = _synthetic({"hmem.store.thing": "x = 1\n" + line + "\n"})
    assert check_state_owns_its_fields([file], state_attributes(_STATE_SOURCE)) == []


def test_self_state_checker_spares_the_state_itself():
    [state_file] = _synthetic({"hmem.store.state": _STATE_SOURCE + "state.n = 1\n"})
    assert state_file.path == STATE_MODULE_FILE
    assert check_state_owns_its_fields([state_file], {"n"}) == []
