"""NVIDIA_REQUIRE_* expressions: NVIDIA's grammar (libnvidia-container ``dsl.c``), parsed strictly.

::

    requirement := term (' ' term)*        space-separated terms are OR'ed
    term        := factor (',' factor)*    comma-separated factors are AND'ed
    factor      := NAME OP VALUE           NAME: cuda, driver, arch, brand (any case)
    OP          := = != < <= > >=

Separate variables must all hold. Versions compare numerically by component
with trailing zeros ignored (``12`` == ``12.0``); brands compare
case-insensitively with ``=``/``!=`` only. Each selected GPU is checked with its
own arch and brand; with no GPU selected, arch and brand terms hold.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

from gpuhook.errors import RequestError

_FACTOR: Final = re.compile(r"([A-Za-z]+)(>=|<=|!=|=|<|>)([0-9A-Za-z.]+)")
_VERSION: Final = re.compile(r"[0-9]{1,6}(?:\.[0-9]{1,6}){0,3}")
_BRAND: Final = re.compile(r"[A-Za-z0-9]{1,32}")
_NAMES: Final = ("cuda", "driver", "arch", "brand")
#: The longest expression: NVIDIA's CUDA 12 images set ~1.6 KiB (a cuda>= and ~40 brand/driver terms).
MAX_LENGTH: Final = 4096
#: The most NVIDIA_REQUIRE_* variables (images set one to three): with MAX_LENGTH, this bounds what an
#: image can make every start of it evaluate (1800 long ones once took 11 s a start).
MAX_REQUIREMENTS: Final = 64

#: Minimum Linux driver per CUDA release (CUDA Toolkit release notes, "CUDA Toolkit and
#: Corresponding Driver Versions", GA releases), for the "upgrade to" hint.
MIN_DRIVER: Final = {
    (11, 0): "450.36.06", (11, 1): "455.23", (11, 2): "460.27.03", (11, 3): "465.19.01",
    (11, 4): "470.42.01", (11, 5): "495.29.05", (11, 6): "510.39.01", (11, 7): "515.43.04",
    (11, 8): "520.61.05", (12, 0): "525.60.13", (12, 1): "530.30.02", (12, 2): "535.54.03",
    (12, 3): "545.23.06", (12, 4): "550.54.14", (12, 5): "555.42.02", (12, 6): "560.28.03",
    (12, 8): "570.26", (12, 9): "575.51.03", (13, 0): "580.65.06",
}


@dataclass(frozen=True, slots=True)
class Factor:
    """One comparison, e.g. ``cuda>=12.4``."""

    name: str
    op: str
    value: str

    def __str__(self) -> str:
        return f"{self.name}{self.op}{self.value}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Requirement:
    """One NVIDIA_REQUIRE_* value: an OR of ANDs of factors."""

    variable: str
    text: str
    terms: tuple[tuple[Factor, ...], ...]

    def __str__(self) -> str:
        return self.text


@dataclass(frozen=True, slots=True, kw_only=True)
class Facts:
    """What a requirement is checked against: the host's versions and one GPU's arch and brand."""

    cuda: str
    driver: str
    arch: str | None = None
    brand: str | None = None


def parse_requirement(variable: str, text: str) -> Requirement:
    """Parse one expression; raises RequestError naming the variable and the bad part."""
    if len(text) > MAX_LENGTH:
        raise RequestError(f"{variable} is {len(text)} characters long; the limit is {MAX_LENGTH}: shorten it "
                           "(or set NVIDIA_DISABLE_REQUIRE=true to skip the image's requirements)")
    terms = []
    for term in text.split():
        factors = []
        for part in term.split(","):
            match = _FACTOR.fullmatch(part)
            name = match[1].lower() if match else ""
            if not match or name not in _NAMES or not _valid_value(name, match[2], match[3]):
                raise RequestError(
                    f"{variable}={text!r}: {part!r} is not a requirement; expected NAME OP VALUE with NAME one of "
                    "cuda, driver, arch, brand, OP one of = != < <= > >= (brand: = or != only), e.g. 'cuda>=12.4'"
                )
            factors.append(Factor(name, match[2], match[3]))
        terms.append(tuple(factors))
    if not terms:
        raise RequestError(f"{variable}={text!r}: empty requirement")
    return Requirement(variable=variable, text=text, terms=tuple(terms))


def _valid_value(name: str, op: str, value: str) -> bool:
    """Versions are dotted numbers; brands are words compared for (in)equality only."""
    if name == "brand":
        return op in ("=", "!=") and bool(_BRAND.fullmatch(value))
    return bool(_VERSION.fullmatch(value))


def _version(text: str) -> tuple[int, ...]:
    """A comparable version with trailing zeros dropped (dsl_compare_version)."""
    parts = [int(p) for p in text.split(".")]
    while len(parts) > 1 and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def _holds(factor: Factor, facts: Facts) -> bool:
    """Whether one factor holds; missing arch/brand (no GPU) holds, as in libnvidia-container."""
    actual = {"cuda": facts.cuda, "driver": facts.driver, "arch": facts.arch, "brand": facts.brand}[factor.name]
    if actual is None:
        return True
    if factor.name == "brand":
        return (actual.casefold() == factor.value.casefold()) == (factor.op == "=")
    left, right = _version(actual), _version(factor.value)
    return {
        "=": left == right, "!=": left != right, "<": left < right,
        "<=": left <= right, ">": left > right, ">=": left >= right,
    }[factor.op]


def satisfied(requirement: Requirement, facts: Facts) -> bool:
    """Whether any term has all of its factors hold."""
    return any(all(_holds(f, facts) for f in term) for term in requirement.terms)


def cuda_needed(requirement: Requirement) -> str | None:
    """The smallest CUDA version a requirement asks for with cuda>= / cuda>, if any."""
    found = [f.value for term in requirement.terms for f in term if f.name == "cuda" and f.op in (">=", ">")]
    return min(found, key=_version) if found else None


def driver_hint(cuda: str) -> str | None:
    """The minimum Linux driver for a CUDA major.minor, when known."""
    parts = (*_version(cuda), 0)
    return MIN_DRIVER.get((parts[0], parts[1]))
