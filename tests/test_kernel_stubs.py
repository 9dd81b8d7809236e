"""The type stubs of the compiled kernels (hmem/kernels/_native/*.pyi)
against the compiled modules themselves.

mypy reads the stubs, never the Cython sources: it checks every call into a
kernel against hmem.kernels' interfaces (hmem/kernels/_interface.py), and
the stubs and the reference twins against those.  A stub that drifts from
its module (a function renamed, a parameter added, a default changed) would
let mypy pass calls that fail at run time, so each stub is held here to its
module: the same public names, and for each function the same parameters in
the same order, of the same kinds, with the same defaults.  The interfaces
and the twins are held to the stubs' parameter names, which mypy does not
compare.

The stubs are read from the installed package, next to the compiled modules
they describe (a wheel ships both).  Signatures come from inspect: Cython 3
compiles functions as binding cyfunctions, which carry their signature.
"""

from __future__ import annotations

import ast
import importlib
import importlib.machinery
import importlib.util
import inspect
import pkgutil
import types
from importlib import resources
from typing import Any

import pytest

import hmem.kernels._native

NATIVE = "hmem.kernels._native"

# A parameter without a default (inspect.Parameter.empty would do, but a
# name of its own reads better in a failure).
NO_DEFAULT = "<no default>"


def compiled_module_names() -> list[str]:
    """Every compiled extension module of the installed hmem.kernels._native."""
    names = []
    for info in pkgutil.iter_modules(hmem.kernels._native.__path__):
        spec = importlib.util.find_spec(f"{NATIVE}.{info.name}")
        if spec is not None and isinstance(spec.loader, importlib.machinery.ExtensionFileLoader):
            names.append(info.name)
    return sorted(names)  # one order on every xdist worker


COMPILED = compiled_module_names()


def test_every_stub_has_its_compiled_module():
    stubs = sorted(p.name.removesuffix(".pyi") for p in resources.files(NATIVE).iterdir() if p.name.endswith(".pyi"))
    assert stubs == COMPILED


# ---- reading a stub ------------------------------------------------------------------


def read_stub(name: str) -> ast.Module:
    stub = resources.files(NATIVE) / f"{name}.pyi"
    assert stub.is_file(), f"{NATIVE}.{name} has no stub {name}.pyi next to it"
    return ast.parse(stub.read_text(encoding="utf-8"), filename=f"{name}.pyi")


def stub_names(tree: ast.Module) -> dict[str, ast.stmt]:
    """The names a stub declares at its top level: functions, classes,
    variables and type aliases.  Imports are left out: hmem's stubs
    re-export none."""
    found: dict[str, ast.stmt] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found[node.name] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            found[node.target.id] = node
        elif isinstance(node, ast.Assign):
            found.update((target.id, node) for target in node.targets if isinstance(target, ast.Name))
        elif not isinstance(node, (ast.Import, ast.ImportFrom, ast.Expr)):
            # an `if sys.version_info ...:` block, say: its names would be
            # missed here, so the test has to learn to read it first
            raise AssertionError(f"line {node.lineno}: this test does not read a {type(node).__name__} in a stub")
    return found


def public(names: dict[str, Any]) -> set[str]:
    return {name for name in names if not name.startswith("_")}


def module_names(module: types.ModuleType) -> set[str]:
    """The public names of a compiled module.  numpy and operator, which some
    kernels import, are not part of its API (nor re-exported by its stub)."""
    return public({k: v for k, v in vars(module).items() if not isinstance(v, types.ModuleType)})


def stub_parameters(function: ast.FunctionDef | ast.AsyncFunctionDef) -> list[tuple[str, str, object]]:
    """(name, kind, default) of each parameter, in order, as inspect names them."""
    args = function.args
    positional = [*args.posonlyargs, *args.args]
    # defaults belong to the last positional parameters
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    out = []
    for i, (arg, default) in enumerate(zip(positional, defaults)):
        kind = "POSITIONAL_ONLY" if i < len(args.posonlyargs) else "POSITIONAL_OR_KEYWORD"
        out.append((arg.arg, kind, _default(default)))
    if args.vararg is not None:
        out.append((args.vararg.arg, "VAR_POSITIONAL", NO_DEFAULT))
    out.extend((arg.arg, "KEYWORD_ONLY", _default(d)) for arg, d in zip(args.kwonlyargs, args.kw_defaults))
    if args.kwarg is not None:
        out.append((args.kwarg.arg, "VAR_KEYWORD", NO_DEFAULT))
    return out


def _default(node: ast.expr | None) -> object:
    # A default spelled `...` would hide the compiled one: stubs give the value.
    return NO_DEFAULT if node is None else ast.literal_eval(node)


def runtime_parameters(function: Any) -> list[tuple[str, str, object]]:
    """(name, kind, default) of each parameter of a function object, as inspect reads them."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError) as exc:
        raise AssertionError(
            f"{function!r} has no introspectable signature ({exc}); a compiled kernel has one when "
            "Cython compiles it as a binding function (binding=True, Cython 3's default)"
        ) from None
    return [
        (p.name, p.kind.name, NO_DEFAULT if p.default is inspect.Parameter.empty else p.default)
        for p in signature.parameters.values()
    ]


# ---- the stubs against the modules ------------------------------------------------------


@pytest.mark.parametrize("name", COMPILED)
def test_stub_declares_exactly_the_public_names_of_its_module(name):
    compiled = module_names(importlib.import_module(f"{NATIVE}.{name}"))
    declared = public(stub_names(read_stub(name)))
    assert declared == compiled, (
        f"{name}.pyi is missing {sorted(compiled - declared)} and declares {sorted(declared - compiled)}, "
        f"which {NATIVE}.{name} does not have"
    )


@pytest.mark.parametrize("name", COMPILED)
def test_stub_functions_are_the_compiled_functions(name):
    module = importlib.import_module(f"{NATIVE}.{name}")
    declared = stub_names(read_stub(name))
    checked = 0
    for attr in sorted(public(declared)):
        node, value = declared[attr], getattr(module, attr)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            assert callable(value), f"{name}.pyi declares {attr}() but {NATIVE}.{name}.{attr} is {value!r}"
            assert stub_parameters(node) == runtime_parameters(value), f"{name}.pyi: parameters of {attr}()"
            checked += 1
        else:
            assert not callable(value), f"{name}.pyi declares {attr} a variable but the module's is a function"
    assert checked >= 3  # the CPU-path switch at least: best_path, select_path, active_path


# The interface each compiled module and its twin in hmem.kernels.reference
# implement (hmem/kernels/_interface.py).
INTERFACES = {
    "_bitops": "BitopsKernels",
    "_checksum": "ChecksumKernels",
    "_entries": "EntriesKernels",
    "_header_text": "HeaderTextKernels",
    "_hamming": "HammingKernels",
    "_projection": "ProjectionKernels",
    "_quantize": "QuantizeKernels",
}


def test_every_compiled_module_has_an_interface():
    # also fails when the compiled modules are missing, which would leave
    # the parametrized tests with nothing to run
    assert sorted(INTERFACES) == COMPILED


@pytest.mark.parametrize("name", COMPILED)
def test_interface_and_twin_name_parameters_as_the_stub_does(name):
    """mypy holds the stub and the reference twin to the interface by
    parameter types and positions but not by name (it lets a positional
    parameter be renamed), while a call by keyword depends on the names:
    so they are compared here."""
    interface = getattr(importlib.import_module("hmem.kernels._interface"), INTERFACES[name])
    twin = importlib.import_module(f"hmem.kernels.reference.{name.removeprefix('_')}")
    declared = stub_names(read_stub(name))
    members = [m for m in dir(interface) if not m.startswith("_") and inspect.isfunction(getattr(interface, m))]
    assert members, f"{INTERFACES[name]} has no methods"
    for member in members:
        node = declared.get(member)
        assert isinstance(node, ast.FunctionDef), f"{INTERFACES[name]}.{member} is not a function of {name}.pyi"
        want = stub_parameters(node)
        # the interface's methods take self first; the modules' functions do not
        assert runtime_parameters(getattr(interface, member))[1:] == want, f"{INTERFACES[name]}.{member}"
        assert runtime_parameters(getattr(twin, member)) == want, f"{twin.__name__}.{member}"


def test_the_check_sees_a_drifted_stub():
    """The comparison itself fails on a renamed parameter, a lost default
    and a missing function, so that a broken reader cannot pass silently."""
    from hmem.kernels._native import _checksum

    def parameters(source: str) -> list[tuple[str, str, object]]:
        (function,) = ast.parse(source).body
        assert isinstance(function, ast.FunctionDef)
        return stub_parameters(function)

    assert parameters("def crc32c(data: bytes, crc: int = 0) -> int: ...") == runtime_parameters(_checksum.crc32c)
    assert parameters("def crc32c(buf: bytes, crc: int = 0) -> int: ...") != runtime_parameters(_checksum.crc32c)
    assert parameters("def crc32c(data: bytes, crc: int) -> int: ...") != runtime_parameters(_checksum.crc32c)
    assert parameters("def crc32c(data: bytes, crc: int = 1) -> int: ...") != runtime_parameters(_checksum.crc32c)
    short = ast.parse("PATH_NAMES: tuple[str, str, str]\ndef crc32c(data: bytes, crc: int = 0) -> int: ...")
    assert module_names(_checksum) - public(stub_names(short)) == {
        "best_path",
        "select_path",
        "active_path",
        "crc32c_rows",
        "crc32c_pieces",
        "read_checked",
    }
