"""MIG instance management in the simulated host's mock NVML, through the real pynvml binding.

Each scenario runs in its own interpreter that loads the host's libnvidia-ml
by absolute path, as gpuhook/nvml/facts.py does: the instances are the
host's (integration/fakehost/mocknvml.c keeps them in etc/mock-nvml/mig-state),
so what one process creates the next one sees.  Building a host needs root.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pynvml
import pytest

from integration.fakehost import FakeHost, create_host, mig

REPO = Path(__file__).resolve().parents[2]
A100_40 = "NVIDIA A100-SXM4-40GB"

# Prepended to every scenario: pynvml bound to the host's NVML, and helpers.
_PRELUDE = '''
import ctypes, json, sys
import pynvml

pynvml.nvmlLib = ctypes.CDLL(sys.argv[1])
pynvml.nvmlInit()
out = {}

def code(fn, *args):
    """The NVML error code fn returns (0 for success)."""
    try:
        fn(*args)
    except pynvml.NVMLError as error:
        return error.value
    return 0

def text(value):
    return value.decode() if isinstance(value, bytes) else value

def gpu(index):
    return pynvml.nvmlDeviceGetHandleByIndex(index)

def profile_id(handle, index):
    """The driver's profile id of NVML_GPU_INSTANCE_PROFILE_<index>, as callers look it up."""
    return pynvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, index).id

def make(handle, index):
    """A GI of the profile and one CI spanning it, as nvidia-smi mig -cgi P -C does."""
    gi = pynvml.nvmlDeviceCreateGpuInstance(handle, profile_id(handle, index))
    info = pynvml.nvmlGpuInstanceGetInfo(gi)
    slices = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, index).sliceCount
    ci_profile = {1: 0, 2: 1, 3: 2, 4: 3, 7: 4}[slices]
    ci = pynvml.nvmlGpuInstanceCreateComputeInstance(gi, ci_profile)
    ci_info = pynvml.nvmlComputeInstanceGetInfo(ci)
    return gi, ci, {"gi": info.id, "start": info.placement.start, "size": info.placement.size,
                    "ci": ci_info.id, "ci_profile": ci_info.profileId}

def mig_devices(handle):
    """(uuid, gi, ci, name, memory) of each MIG device, as gpuhook's discovery enumerates them."""
    found = []
    for slot in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
        try:
            dev = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
        except pynvml.NVMLError_NotFound:
            continue
        found.append([text(pynvml.nvmlDeviceGetUUID(dev)), pynvml.nvmlDeviceGetGpuInstanceId(dev),
                      pynvml.nvmlDeviceGetComputeInstanceId(dev), text(pynvml.nvmlDeviceGetName(dev)),
                      pynvml.nvmlDeviceGetMemoryInfo(dev).total])
    return found
'''


def _script(body: str) -> str:
    return _PRELUDE + textwrap.dedent(body) + "\npynvml.nvmlShutdown()\nprint(json.dumps(out))\n"


def run(host: FakeHost, body: str) -> dict[str, Any]:
    """Runs one scenario in a fresh interpreter; returns its `out`."""
    result = subprocess.run(
        [sys.executable, "-c", _script(body), str(host.nvml_library)],
        capture_output=True, text=True, check=False, cwd=REPO, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])  # type: ignore[no-any-return]


@pytest.fixture
def a100(tmp_path: Path) -> FakeHost:
    """An A100-40GB in MIG mode with no instances, and a second A100 with MIG off."""
    return create_host(tmp_path / "host", gpus=2, model=A100_40, mig={0: ()})


def _profile(host: FakeHost, name: str) -> mig.MigProfile:
    return next(p for p in mig.MIG_PROFILES[host.model] if p.name == name)


def _cap_paths(host: FakeHost, gi: int, ci: int) -> list[tuple[Path, Path, int]]:
    """(capability file, node, minor) of a GI and its CI on GPU 0."""
    caps = host.capabilities_dir / "gpu0/mig"
    out = []
    for rel, minor in ((f"gi{gi}/access", mig.gi_minor(0, gi)), (f"gi{gi}/ci{ci}/access", mig.ci_minor(0, gi, ci))):
        out.append((caps / rel, host.root / f"dev/nvidia-caps/nvidia-cap{minor}", minor))
    return out


def test_create_3g_is_seen_by_another_process(a100: FakeHost) -> None:
    """A 3g.20gb GI + CI made in one process: another sees the MIG device, its UUID, caps files and nodes."""
    made = run(a100, "_gi, _ci, out['made'] = make(gpu(0), pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE)")["made"]
    # The driver's first 3g placement is the lowest free one: slices 0-3, GI id 1; CI ids start at 0.
    assert made == {"gi": 1, "start": 0, "size": 4, "ci": 0, "ci_profile": pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE}
    seen = run(a100, '''
        out["migs"] = mig_devices(gpu(0))
        out["gpu1"] = mig_devices(gpu(1)) if code(pynvml.nvmlDeviceGetMigMode, gpu(1)) else None
        gi = pynvml.nvmlDeviceGetGpuInstanceById(gpu(0), 1)
        info = pynvml.nvmlGpuInstanceGetInfo(gi)
        out["gi"] = [info.id, info.profileId, info.placement.start, info.placement.size]
        cis = (pynvml.c_nvmlComputeInstance_t * 3)()
        count = ctypes.c_uint()
        three = pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE
        pynvml.nvmlGpuInstanceGetComputeInstances(gi, three, cis, ctypes.byref(count))
        out["cis"] = count.value
        out["by_uuid"] = pynvml.nvmlDeviceGetGpuInstanceId(pynvml.nvmlDeviceGetHandleByUUID(out["migs"][0][0]))
    ''')
    uuid = mig.mig_uuid(a100.driver_version, 0, 1, 0)
    assert seen["migs"] == [[uuid, 1, 0, f"{A100_40} MIG 3g.20gb", 19968 * 2**20]]
    assert seen["gi"] == [1, 9, 0, 4] and seen["cis"] == 1 and seen["by_uuid"] == 1
    for path, node, minor in _cap_paths(a100, 1, 0):
        assert path.read_text() == mig.capability_file(minor, mig.ACCESS_MODE)
        assert stat.S_IMODE(path.stat().st_mode) == 0o444
        info = node.stat()
        assert stat.S_ISCHR(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o444
        assert (os.major(info.st_rdev), os.minor(info.st_rdev)) == (a100.caps_major, minor)
    # gpuhook's own discovery, in a fresh process, sees it the same way.
    discovered = subprocess.run(
        [sys.executable, "-c", "import sys; from gpuhook.nvml.facts import read_nvml; from pathlib import Path;"
         "print([(m.uuid, m.gi, m.ci) for m in read_nvml(Path(sys.argv[1])).mig_devices])", str(a100.nvml_library)],
        capture_output=True, text=True, check=True, cwd=REPO,
    )
    assert discovered.stdout.strip() == repr([(uuid, 1, 0)])


def test_two_3g_fit_and_a_third_does_not(a100: FakeHost) -> None:
    """3g.20gb: placements 0 and 4; the third create is INSUFFICIENT_RESOURCES."""
    first = run(a100, "_gi, _ci, out['made'] = make(gpu(0), pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE)")["made"]
    got = run(a100, '''
        _gi, _ci, out["made"] = make(gpu(0), pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE)
        pid = profile_id(gpu(0), pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE)
        out["left"] = pynvml.nvmlDeviceGetGpuInstanceRemainingCapacity(gpu(0), pid)
        out["third"] = code(pynvml.nvmlDeviceCreateGpuInstance, gpu(0), pid)
        out["1g_left"] = pynvml.nvmlDeviceGetGpuInstanceRemainingCapacity(gpu(0), profile_id(gpu(0), 0))
    ''')
    assert (first["gi"], first["start"]) == (1, 0)
    assert (got["made"]["gi"], got["made"]["start"]) == (2, 4)
    assert got["left"] == 0 and got["third"] == pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES
    assert got["1g_left"] == 0  # the two 3g instances cover all 8 memory slices


def test_seven_1g_fit_and_an_eighth_does_not(a100: FakeHost) -> None:
    """1g.5gb: starts 0-6, GI ids 7-13; the eighth is INSUFFICIENT_RESOURCES, and MIG devices number 7."""
    got = run(a100, '''
        pid = profile_id(gpu(0), pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE)
        out["left0"] = pynvml.nvmlDeviceGetGpuInstanceRemainingCapacity(gpu(0), pid)
        out["made"] = [make(gpu(0), pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE)[2] for _ in range(7)]
        out["eighth"] = code(pynvml.nvmlDeviceCreateGpuInstance, gpu(0), pid)
        out["migs"] = len(mig_devices(gpu(0)))
    ''')
    assert got["left0"] == 7
    assert [(m["gi"], m["start"], m["size"]) for m in got["made"]] == [(7 + s, s, 1) for s in range(7)]
    assert got["eighth"] == pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES and got["migs"] == 7


def test_destroy_ci_then_gi(a100: FakeHost) -> None:
    """A GI with a CI is IN_USE; CI then GI destroy; files, nodes and the MIG device are gone for everyone."""
    run(a100, "make(gpu(0), pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE)")
    got = run(a100, '''
        gi = pynvml.nvmlDeviceGetGpuInstanceById(gpu(0), 1)
        out["gi_first"] = code(pynvml.nvmlGpuInstanceDestroy, gi)
        ci = pynvml.nvmlGpuInstanceGetComputeInstanceById(gi, 0)
        out["ci"] = code(pynvml.nvmlComputeInstanceDestroy, ci)
        out["ci_again"] = code(pynvml.nvmlComputeInstanceDestroy, ci)
        out["gi"] = code(pynvml.nvmlGpuInstanceDestroy, gi)
        out["gi_info_after"] = code(pynvml.nvmlGpuInstanceGetInfo, gi)
    ''')
    assert got == {"gi_first": pynvml.NVML_ERROR_IN_USE, "ci": 0, "ci_again": pynvml.NVML_ERROR_INVALID_ARGUMENT,
                   "gi": 0, "gi_info_after": pynvml.NVML_ERROR_INVALID_ARGUMENT}
    for path, node, _minor in _cap_paths(a100, 1, 0):
        assert not path.exists() and not node.exists()
    assert not (a100.capabilities_dir / "gpu0/mig/gi1").exists()
    after = run(a100, '''
        out["migs"] = mig_devices(gpu(0))
        out["by_id"] = code(pynvml.nvmlDeviceGetGpuInstanceById, gpu(0), 1)
        out["left"] = pynvml.nvmlDeviceGetGpuInstanceRemainingCapacity(gpu(0), profile_id(gpu(0), 2))
    ''')
    assert after == {"migs": [], "by_id": pynvml.NVML_ERROR_NOT_FOUND, "left": 2}


def test_concurrent_creates_get_distinct_placements(a100: FakeHost) -> None:
    """Seven processes released together each create a 1g.5gb GI + CI: seven distinct placements."""
    body = '''
        handle = gpu(0)
        print("ready", flush=True)
        sys.stdin.readline()  # the go signal: every process is loaded and initialised
        _gi, _ci, out["made"] = make(handle, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE)
    '''
    procs = [
        subprocess.Popen([sys.executable, "-c", _script(body), str(a100.nvml_library)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
        for _ in range(7)
    ]
    for proc in procs:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
    made = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr
        made.append(json.loads(stdout.splitlines()[-1])["made"])
    assert sorted(m["start"] for m in made) == list(range(7))
    assert sorted(m["gi"] for m in made) == list(range(7, 14))
    assert {m["ci"] for m in made} == {0}
    assert len(run(a100, "out['migs'] = mig_devices(gpu(0))")["migs"]) == 7


def test_invalid_arguments_and_not_found(a100: FakeHost) -> None:
    """Unknown profile ids, illegal placements, unknown GI ids, a GPU without MIG mode (which still lists profiles)."""
    got = run(a100, '''
        h = gpu(0)
        info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo
        out["bad_index"] = code(info, h, pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT)
        out["absent_index"] = code(info, h, pynvml.NVML_GPU_INSTANCE_PROFILE_6_SLICE)
        out["bad_id"] = code(pynvml.nvmlDeviceCreateGpuInstance, h, 42)
        # nvml.h takes the placement by pointer; pynvml passes what it is given, so callers pass byref().
        def at(start, size):
            return ctypes.byref(pynvml.c_nvmlGpuInstancePlacement_t(start, size))
        out["bad_start"] = code(pynvml.nvmlDeviceCreateGpuInstanceWithPlacement, h, 9, at(2, 4))  # 3g: 0 or 4 only
        out["bad_size"] = code(pynvml.nvmlDeviceCreateGpuInstanceWithPlacement, h, 9, at(4, 2))
        gi = pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(h, 9, at(4, 4))
        out["placed"] = pynvml.nvmlGpuInstanceGetInfo(gi).id
        out["taken"] = code(pynvml.nvmlDeviceCreateGpuInstanceWithPlacement, h, 9, at(4, 4))
        four = pynvml.NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE
        out["ci_bad"] = code(pynvml.nvmlGpuInstanceCreateComputeInstance, gi, four)
        out["no_gi"] = code(pynvml.nvmlDeviceGetGpuInstanceById, h, 3)
        out["no_ci"] = code(pynvml.nvmlGpuInstanceGetComputeInstanceById, gi, 0)
        pynvml.nvmlGpuInstanceDestroy(gi)
        off = gpu(1)
        out["off"] = [code(info, off, 0), code(pynvml.nvmlDeviceCreateGpuInstance, off, 19),
                      code(pynvml.nvmlDeviceGetGpuInstanceRemainingCapacity, off, 19)]
    ''')
    invalid, not_supported = pynvml.NVML_ERROR_INVALID_ARGUMENT, pynvml.NVML_ERROR_NOT_SUPPORTED
    assert got == {
        "bad_index": invalid, "absent_index": not_supported, "bad_id": invalid, "bad_start": invalid,
        "bad_size": invalid, "placed": 2, "taken": pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES, "ci_bad": invalid,
        "no_gi": pynvml.NVML_ERROR_NOT_FOUND, "no_ci": pynvml.NVML_ERROR_NOT_FOUND,
        "off": [0, not_supported, not_supported],  # profile info is answered with MIG mode off too
    }


def test_gpu_without_mig_is_not_supported(tmp_path: Path) -> None:
    """A GPU that has no MIG at all (Tesla T4): every management call is NOT_SUPPORTED."""
    host = create_host(tmp_path / "host", gpus=1, model="Tesla T4")
    got = run(host, '''
        h = gpu(0)
        out["codes"] = [code(pynvml.nvmlDeviceGetGpuInstanceProfileInfo, h, 0),
                        code(pynvml.nvmlDeviceCreateGpuInstance, h, 19),
                        code(pynvml.nvmlDeviceGetGpuInstanceById, h, 1)]
    ''')
    assert got["codes"] == [pynvml.NVML_ERROR_NOT_SUPPORTED] * 3


@pytest.mark.parametrize("model", sorted(mig.MIG_PROFILES))
def test_profile_info_matches_the_tables(tmp_path: Path, model: str) -> None:
    """Per model: v1, v2 and v3 profile info, placements and capacity are mig.py's table."""
    host = create_host(tmp_path / "host", gpus=1, model=model, mig={0: ()})
    got = run(host, '''
        class V3(ctypes.Structure):
            _fields_ = [(n, ctypes.c_uint) for n in ("version", "id", "sliceCount", "instanceCount",
                        "multiprocessorCount", "copyEngineCount", "decoderCount", "encoderCount", "jpegCount",
                        "ofaCount")] + [("memorySizeMB", ctypes.c_ulonglong), ("name", ctypes.c_char * 96),
                        ("capabilities", ctypes.c_uint)]
        h = gpu(0)
        out["profiles"] = {}
        for index in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
            if code(pynvml.nvmlDeviceGetGpuInstanceProfileInfo, h, index) == pynvml.NVML_ERROR_NOT_SUPPORTED:
                continue
            v1 = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(h, index, 1)
            v2 = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(h, index)
            v3 = V3(version=ctypes.sizeof(V3) | 3 << 24)
            assert pynvml.nvmlLib.nvmlDeviceGetGpuInstanceProfileInfoV(h, index, ctypes.byref(v3)) == 0
            placements = (pynvml.c_nvmlGpuInstancePlacement_t * 8)()
            count = ctypes.c_uint()
            pynvml.nvmlDeviceGetGpuInstancePossiblePlacements(h, v2.id, placements, ctypes.byref(count))
            fields = ("id", "sliceCount", "instanceCount", "multiprocessorCount", "copyEngineCount", "decoderCount",
                      "encoderCount", "jpegCount", "ofaCount", "memorySizeMB")
            rows = [[getattr(v, f) for f in fields] for v in (v1, v2, v3)]
            assert rows[0] == rows[1] == rows[2]
            out["profiles"][text(v2.name)] = {
                "index": index, "row": [getattr(v2, f) for f in fields], "v3": text(v3.name),
                "placements": [[placements[i].start, placements[i].size] for i in range(count.value)],
                "left": pynvml.nvmlDeviceGetGpuInstanceRemainingCapacity(h, v2.id),
            }
        bad = V3(version=1)
        out["bad_version"] = pynvml.nvmlLib.nvmlDeviceGetGpuInstanceProfileInfoV(h, 0, ctypes.byref(bad))
    ''')
    want = {
        f"MIG {p.name}": {
            "index": p.index,
            "row": [p.profile_id, p.slices, p.instances, p.sms, p.copy_engines, p.decoders, p.encoders, p.jpegs,
                    p.ofas, p.memory_mib],
            "v3": f"MIG {p.name}",
            "placements": [[start, p.memory_slices] for start in p.starts],
            "left": p.instances,
        }
        for p in mig.MIG_PROFILES[model]
    }
    assert got["profiles"] == want
    assert got["bad_version"] == pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH


def test_admin_made_instances_count(tmp_path: Path) -> None:
    """Instances made at build time occupy their placements; NVML adds beside them and can destroy them."""
    host = create_host(tmp_path / "host", gpus=1, model=A100_40, mig={0: ("3g.20gb",)})
    got = run(host, '''
        h = gpu(0)
        out["left"] = pynvml.nvmlDeviceGetGpuInstanceRemainingCapacity(h, 9)
        _gi, _ci, out["made"] = make(h, pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE)
        out["third"] = code(pynvml.nvmlDeviceCreateGpuInstance, h, 9)
        out["migs"] = [m[:3] for m in mig_devices(h)]
    ''')
    admin = host.mig_devices[0]
    assert got["left"] == 1 and got["third"] == pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES
    assert (got["made"]["gi"], got["made"]["start"]) == (2, 4)
    assert got["migs"] == [[admin.uuid, 1, 0], [mig.mig_uuid(host.driver_version, 0, 2, 0), 2, 0]]


def test_swizzle_ids_match_the_c_side() -> None:
    """mig.swizzle_gi_id is the id mocknvml.c gives a placement (checked end to end above for 1g and 3g)."""
    assert [mig.swizzle_gi_id(s, 1) for s in range(8)] == list(range(7, 15))
    assert [mig.swizzle_gi_id(s, 2) for s in (0, 2, 4, 6)] == [3, 4, 5, 6]
    assert [mig.swizzle_gi_id(s, 4) for s in (0, 4)] == [1, 2] and mig.swizzle_gi_id(0, 8) == 0
