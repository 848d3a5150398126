"""NVIDIA_REQUIRE_* grammar, evaluation per GPU, and the driver-mismatch message."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuhook.errors import RequestError
from gpuhook.planning.requirements import RequirementError, check_requirements
from gpuhook.request.requirements import Facts, parse_requirement, satisfied

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
