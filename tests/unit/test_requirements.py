"""NVIDIA_REQUIRE_* grammar, evaluation per GPU, and the driver-mismatch message."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuhook.errors import RequestError
from gpuhook.planning import requirements as planning_requirements
from gpuhook.planning.requirements import RequirementError, check_requirements
from gpuhook.request.parse import parse_requirements
from gpuhook.request.requirements import (
    MAX_LENGTH,
    MAX_REQUIREMENTS,
    Facts,
    Requirement,
    parse_requirement,
    satisfied,
)

from .test_planner import _gpu, inventory

HOST = Facts(cuda="12.4", driver="550.54.15", arch="9.0", brand="Tesla")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param("cuda>=12.4", True, id="equal-version"),
        pytest.param("cuda>=12.4.0", True, id="trailing-zero"),
        pytest.param("cuda>12.4", False, id="strictly-greater"),
        pytest.param("cuda>=12.6", False, id="newer-cuda"),
        pytest.param("cuda>=12.6 cuda>=11.0", True, id="space-is-or"),
        pytest.param("brand=tesla,driver>=550,driver<551", True, id="comma-is-and-case-insensitive"),
        pytest.param("brand=geforce,driver>=470", False, id="wrong-brand"),
        pytest.param("brand!=geforce", True, id="brand-not-equal"),
        pytest.param("arch>=8.0", True, id="arch"),
        pytest.param("ARCH=9", True, id="name-any-case-and-zeros"),
        pytest.param("driver<550.54.15", False, id="driver-lt"),
        pytest.param("driver<=550.54.15", True, id="driver-le"),
    ],
)
def test_evaluation(text: str, expected: bool) -> None:
    """NVIDIA's semantics on an H100 with driver 550.54.15 (CUDA 12.4)."""
    assert satisfied(parse_requirement("NVIDIA_REQUIRE_CUDA", text), HOST) is expected


def test_missing_gpu_facts_hold() -> None:
    """With no GPU selected, arch and brand terms hold (libnvidia-container: dev=NULL)."""
    assert satisfied(parse_requirement("R", "arch>=99.0,brand=quadro"), Facts(cuda="12.4", driver="550"))


@pytest.mark.parametrize(
    "text",
    ["cuda>=", "cuda=>12", "cuda>=12.4 || $(reboot)", "gpu>=1", "brand>=tesla", "cuda>=12.x", "cuda>=-1",
     "brand=tes la,", ",", "cuda>=12..4"],
)
def test_malformed_requirements_are_refused(text: str) -> None:
    """Anything outside the grammar is refused with the variable named."""
    with pytest.raises(RequestError, match="NVIDIA_REQUIRE_CUDA"):
        parse_requirement("NVIDIA_REQUIRE_CUDA", text)


def test_driver_mismatch_message_says_what_to_do() -> None:
    """The #1 support question gets the requirement, the host's versions and the ways out."""
    with pytest.raises(RequirementError) as excinfo:
        check_requirements((parse_requirement("NVIDIA_REQUIRE_CUDA", "cuda>=12.6"),), inventory(), (_gpu(0),))
    message = str(excinfo.value)
    for text in ("NVIDIA_REQUIRE_CUDA='cuda>=12.6'", "driver 550.54.15 supports CUDA 12.4",
                 "upgrade the driver to 560.28.03 or newer", "forward compatibility", "CUDA 12.4 or older",
                 "NVIDIA_DISABLE_REQUIRE=true"):
        assert text in message


def test_requirements_are_checked_per_gpu() -> None:
    """A brand term is checked against every selected GPU and names the one that fails."""
    gpus = (_gpu(0), replace(_gpu(1), brand="GeForce", model="NVIDIA GeForce RTX 4090"))
    with pytest.raises(RequirementError, match=r"GPU 1 \(NVIDIA GeForce RTX 4090, arch 9\.0, brand GeForce\)"):
        check_requirements((parse_requirement("NVIDIA_REQUIRE_BRAND", "brand=tesla"),), inventory(), gpus)
    check_requirements((parse_requirement("NVIDIA_REQUIRE_BRAND", "brand=tesla"),), inventory(), gpus[:1])


@given(st.text(max_size=40))
def test_any_requirement_text_parses_or_raises_our_error(text: str) -> None:
    """Container input never produces another exception, and parsed ones evaluate."""
    try:
        requirement = parse_requirement("NVIDIA_REQUIRE_X", text)
    except RequestError:
        return
    assert satisfied(requirement, HOST) in (True, False)


def test_too_many_requirements_are_refused_before_any_is_parsed() -> None:
    """65 NVIDIA_REQUIRE_* variables: refused naming the prefix, the count and the limit; 64 are fine."""
    env = {f"NVIDIA_REQUIRE_X{i:04d}": "cuda>=1.0" for i in range(MAX_REQUIREMENTS)}
    assert len(parse_requirements(env, legacy=False)) == MAX_REQUIREMENTS
    env["NVIDIA_REQUIRE_X9999"] = "not even parsed"
    with pytest.raises(RequestError, match=rf"sets {MAX_REQUIREMENTS + 1} NVIDIA_REQUIRE_\* variables "
                                           rf"\(NVIDIA_REQUIRE_X0000, \.\.\., NVIDIA_REQUIRE_X9999\); the limit is "
                                           rf"{MAX_REQUIREMENTS}.*NVIDIA_DISABLE_REQUIRE=true"):
        parse_requirements(env, legacy=False)
    assert parse_requirements({**env, "NVIDIA_DISABLE_REQUIRE": "true"}, legacy=False) == ()


def test_an_overlong_requirement_is_refused_with_its_length() -> None:
    """One expression over MAX_LENGTH names the variable, its length and the limit; a CUDA 12 image's fits."""
    cuda12 = "cuda>=12.4 " + " ".join(f"brand={b},driver>={d},driver<{d + 1}" for b in (
        "tesla", "unknown", "nvidia", "nvidiartx", "geforce", "geforcertx", "quadro", "quadrortx", "titan",
        "titanrtx") for d in (470, 525, 535, 545))
    assert len(cuda12) > 1400 and parse_requirement("NVIDIA_REQUIRE_CUDA", cuda12).terms
    text = "cuda>=12.4 " * (MAX_LENGTH // 11 + 1)
    with pytest.raises(RequestError, match=rf"NVIDIA_REQUIRE_CUDA is {len(text)} characters long; the limit is "
                                           rf"{MAX_LENGTH}"):
        parse_requirement("NVIDIA_REQUIRE_CUDA", text)


def test_requirements_are_evaluated_once_per_kind_of_gpu_not_per_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """64 identical GPUs cost one evaluation per requirement; a GPU of another brand costs one more."""
    calls: list[Facts] = []

    def counting(requirement: Requirement, facts: Facts) -> bool:
        calls.append(facts)
        return satisfied(requirement, facts)

    monkeypatch.setattr(planning_requirements, "satisfied", counting)
    requirements = tuple(parse_requirement(f"NVIDIA_REQUIRE_{i}", "cuda>=12.0 brand=tesla") for i in range(8))
    gpus = tuple(replace(_gpu(0), index=i, minor=i) for i in range(64))
    check_requirements(requirements, inventory(), gpus)
    assert len(calls) == len(requirements)
    calls.clear()
    check_requirements(requirements, inventory(), (*gpus, replace(_gpu(1), brand="GeForce")))
    assert len(calls) == 2 * len(requirements)
    calls.clear()
    check_requirements(requirements, inventory(), ())
    assert len(calls) == len(requirements) and calls[0].arch is None
