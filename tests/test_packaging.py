"""The dependency ranges hmem declares are the ones CI runs.

.ci/run installs hmem twice: with the newest releases its ranges admit, and
under .ci/oldest.txt, which pins every dependency to its declared lower
bound.  These tests keep that file and pyproject.toml in step, and check
that the reference kernels give the same answers on every NumPy hmem
accepts.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from hmem.kernels import hamming
from hmem.kernels.reference import hamming as ref_hamming

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = ROOT / "pyproject.toml"
OLDEST = ROOT / ".ci" / "oldest.txt"

# The operators that give a range its lower bound: ~=X means >=X and ==X.*.
LOWER_BOUND_OPERATORS = (">=", "~=", "==")


def declared_requirements() -> list[Requirement]:
    try:
        import tomllib
    except ImportError:  # Python 3.10: tomllib came with 3.11
        pytest.skip("reading pyproject.toml needs tomllib (Python 3.11 or later)")
    if not PYPROJECT.is_file() or not OLDEST.is_file():
        pytest.skip("the checkout's pyproject.toml and .ci/oldest.txt are not beside these tests")
    project = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["project"]
    texts = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        texts.extend(extra)
    return [Requirement(text) for text in texts]


def lower_bound(requirement: Requirement) -> Version | None:
    bounds = [Version(spec.version) for spec in requirement.specifier if spec.operator in LOWER_BOUND_OPERATORS]
    return max(bounds) if bounds else None


def oldest_pins() -> dict[str, Version]:
    pins: dict[str, Version] = {}
    for line in OLDEST.read_text(encoding="utf-8").splitlines():
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        pin = Requirement(text)
        (spec,) = pin.specifier
        assert spec.operator == "==", f".ci/oldest.txt: {line!r} is not an exact pin (name==version)"
        name = canonicalize_name(pin.name)
        assert name not in pins, f".ci/oldest.txt pins {pin.name} twice"
        pins[name] = Version(spec.version)
    return pins


def test_every_declared_dependency_has_a_lower_bound():
    unbounded = [str(r) for r in declared_requirements() if lower_bound(r) is None]
    assert not unbounded, f"these dependencies declare no lower bound for CI to test: {unbounded}"


def test_each_lower_bound_is_the_pin_ci_installs():
    # A package in several extras (obstore in s3 and test) must declare one bound.
    requirements = declared_requirements()
    declared: dict[str, set[Version]] = {}
    for requirement in requirements:
        bound = lower_bound(requirement)
        if bound is not None:
            declared.setdefault(canonicalize_name(requirement.name), set()).add(bound)
    pins = oldest_pins()
    problems = []
    for name, bounds in sorted(declared.items()):
        if len(bounds) > 1:
            problems.append(f"{name}: pyproject.toml's lists give different lower bounds {sorted(map(str, bounds))}")
        elif name not in pins:
            problems.append(f"{name}: no pin in .ci/oldest.txt (add {name}=={next(iter(bounds))})")
        elif pins[name] not in bounds:
            problems.append(f"{name}: pyproject.toml says >={next(iter(bounds))}, .ci/oldest.txt pins {pins[name]}")
    for name in sorted(set(pins) - {canonicalize_name(r.name) for r in requirements}):
        problems.append(f"{name}: pinned in .ci/oldest.txt but not a dependency in pyproject.toml")
    assert not problems, "\n".join(problems)


def test_the_pins_admit_themselves():
    # A pin outside its own range (above a declared upper bound) would make
    # the oldest environment uninstallable.
    pins = oldest_pins()
    for requirement in declared_requirements():
        pin = pins.get(canonicalize_name(requirement.name))
        assert pin is None or requirement.specifier.contains(pin, prereleases=True), (requirement, pin)


def test_reference_popcount_table_counts_every_byte():
    # NumPy 1.x has no np.bitwise_count: the reference Hamming kernel then
    # counts bits through its table, which must agree with NumPy 2's count.
    values = np.arange(256, dtype=np.uint8)
    want = np.array([bin(v).count("1") for v in range(256)])
    np.testing.assert_array_equal(ref_hamming._table_popcount(values), want)
    if hasattr(np, "bitwise_count"):
        np.testing.assert_array_equal(np.bitwise_count(values), want)


def test_reference_distances_are_the_same_with_the_table_and_match_the_native_kernel(monkeypatch):
    rng = np.random.default_rng(7)
    sigs = rng.integers(0, 256, (300, 64), dtype=np.uint8)
    query = rng.integers(0, 256, 64, dtype=np.uint8)
    chosen = ref_hamming.distances(query, sigs)
    monkeypatch.setattr(ref_hamming, "_byte_popcount", ref_hamming._table_popcount)
    with_table = ref_hamming.distances(query, sigs)
    assert with_table.dtype == chosen.dtype == np.int32
    np.testing.assert_array_equal(with_table, chosen)
    np.testing.assert_array_equal(hamming.distances(query, sigs), chosen)
