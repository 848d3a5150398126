"""NVML's running-process lists in the simulated host's mock NVML, through the real pynvml binding.

The processes are the host's (FakeHost.set_gpu_processes writes etc/mock-nvml/processes, which
integration/fakehost/mocknvml.c reads at every call) and real processes of this machine: the mock,
like the driver, lists only those still running.  Each scenario runs in a fresh interpreter bound
to one host's libnvidia-ml, as in test_mig_management.py.  Building a host needs root.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pynvml
import pytest

from integration.fakehost import FakeHost, FakeHostError, create_host

REPO = Path(__file__).resolve().parents[2]
NO_ID = 0xFFFFFFFF
GIB = 2**30

_PRELUDE = '''
import ctypes, json, os, sys
import pynvml

pynvml.nvmlLib = ctypes.CDLL(sys.argv[1])
pynvml.nvmlInit()
out = {}

def gpu(index):
    return pynvml.nvmlDeviceGetHandleByIndex(index)

def procs(listed):
    return [[p.pid, p.usedGpuMemory, p.gpuInstanceId, p.computeInstanceId] for p in listed]

def compute(handle):
    return procs(pynvml.nvmlDeviceGetComputeRunningProcesses(handle))

def graphics(handle):
    return procs(pynvml.nvmlDeviceGetGraphicsRunningProcesses(handle))

def code(fn, *args):
    try:
        fn(*args)
    except pynvml.NVMLError as error:
        return error.value
    return 0
'''


def run(host: FakeHost, body: str) -> dict[str, Any]:
    """Runs one scenario in a fresh interpreter; returns its `out`."""
    script = _PRELUDE + textwrap.dedent(body) + "\npynvml.nvmlShutdown()\nprint(json.dumps(out))\n"
    result = subprocess.run(
        [sys.executable, "-c", script, str(host.nvml_library)],
        capture_output=True, text=True, check=False, cwd=REPO, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])  # type: ignore[no-any-return]


@pytest.fixture
def sleepers() -> Iterator[list[int]]:
    """Three running processes of this machine (pids), killed and reaped afterwards."""
    children = [subprocess.Popen(["sleep", "300"]) for _ in range(3)]
    yield [child.pid for child in children]
    for child in children:
        child.kill()
        child.wait()


def _dead_pid() -> int:
    """A pid that ran and has been reaped."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


@pytest.fixture
def host(tmp_path: Path) -> FakeHost:
    """Two H100s, MIG off."""
    return create_host(tmp_path / "host", gpus=2)


def test_lists_the_live_processes_of_each_gpu(host: FakeHost, sleepers: list[int]) -> None:
    """Compute and graphics lists per GPU, used bytes as given ('-': not available), no instance ids."""
    a, b, c = sleepers
    host.set_gpu_processes([(0, a, 3 * GIB), (0, b, 512), (1, c, None)], graphics=[(1, a, 7)])
    got = run(host, '''
        out["compute"] = [compute(gpu(0)), compute(gpu(1))]
        out["graphics"] = [graphics(gpu(0)), graphics(gpu(1))]
        out["v2"] = procs(pynvml.nvmlDeviceGetComputeRunningProcesses_v2(gpu(0)))
        out["graphics_v2"] = procs(pynvml.nvmlDeviceGetGraphicsRunningProcesses_v2(gpu(1)))
    ''')
    assert got["compute"] == [[[a, 3 * GIB, NO_ID, NO_ID], [b, 512, NO_ID, NO_ID]], [[c, None, NO_ID, NO_ID]]]
    assert got["graphics"] == [[], [[a, 7, NO_ID, NO_ID]]]
    assert got["v2"] == got["compute"][0] and got["graphics_v2"] == got["graphics"][1]
    assert (host.root / "etc/mock-nvml/processes").read_text() == (
        f"0 {a} {3 * GIB}\n0 {b} 512\n1 {c} -\ngraphics 1 {a} 7\n"
    )


def test_processes_that_exited_are_dropped(host: FakeHost, sleepers: list[int]) -> None:
    """A reaped pid and a zombie (exited, not yet waited for) are not listed; the file is re-read at every call."""
    zombie = subprocess.Popen(["true"])
    try:
        deadline = time.monotonic() + 10
        while Path(f"/proc/{zombie.pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        host.set_gpu_processes([(0, _dead_pid(), 1), (0, sleepers[0], 2), (0, zombie.pid, 3)])
        processes = host.root / "etc/mock-nvml/processes"
        got = run(host, f'''
            out["first"] = compute(gpu(0))
            # Another process rewrites the list (by rename) while this one runs.
            with open({str(processes)!r} + ".new", "w") as f:
                f.write("0 {sleepers[1]} 9\\n")
            os.replace({str(processes)!r} + ".new", {str(processes)!r})
            out["second"] = compute(gpu(0))
        ''')
    finally:
        zombie.wait()
    assert got == {"first": [[sleepers[0], 2, NO_ID, NO_ID]], "second": [[sleepers[1], 9, NO_ID, NO_ID]]}


def test_empty_lists(host: FakeHost, sleepers: list[int]) -> None:
    """No file, an empty one and one of dead pids all list nothing, with NVML_SUCCESS and a count of 0."""
    script = '''
        count = ctypes.c_uint(0)
        out["ret"] = pynvml.nvmlLib.nvmlDeviceGetComputeRunningProcesses_v3(gpu(0), ctypes.byref(count), None)
        out["count"] = count.value
        out["lists"] = [compute(gpu(0)), compute(gpu(1)), graphics(gpu(0))]
    '''
    empty = {"ret": 0, "count": 0, "lists": [[], [], []]}
    assert not (host.root / "etc/mock-nvml/processes").exists()
    assert run(host, script) == empty
    host.set_gpu_processes([])
    assert run(host, script) == empty
    host.set_gpu_processes([(0, _dead_pid(), 1)], graphics=[(0, _dead_pid(), 1)])
    assert run(host, script) == empty
    host.set_gpu_processes([(1, sleepers[0], 1)])  # another GPU's process
    assert run(host, script) == {"ret": 0, "count": 0, "lists": [[], [[sleepers[0], 1, NO_ID, NO_ID]], []]}


def test_short_buffer_reports_the_count(host: FakeHost, sleepers: list[int]) -> None:
    """As NVML: count 0 with NULL asks the size, a short buffer is INSUFFICIENT_SIZE with the count set; v1 layout."""
    a, b, c = sleepers
    host.set_gpu_processes([(0, a, 10), (0, b, 20), (0, c, 30)])
    got = run(host, '''
        fn = pynvml.nvmlLib.nvmlDeviceGetComputeRunningProcesses_v3
        count = ctypes.c_uint(0)
        out["probe"] = [fn(gpu(0), ctypes.byref(count), None), count.value]
        count = ctypes.c_uint(2)
        out["null_with_count"] = fn(gpu(0), ctypes.byref(count), None)
        out["null_count"] = fn(gpu(0), None, None)
        infos = (pynvml.c_nvmlProcessInfo_v3_t * 4)()
        count = ctypes.c_uint(2)
        out["short"] = [fn(gpu(0), ctypes.byref(count), infos), count.value, infos[0].pid, infos[1].pid, infos[2].pid]
        count = ctypes.c_uint(4)
        out["enough"] = [fn(gpu(0), ctypes.byref(count), infos), count.value, [infos[i].pid for i in range(4)]]

        class V1(ctypes.Structure):
            _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong)]
        assert ctypes.sizeof(V1) == 16 and ctypes.sizeof(pynvml.c_nvmlProcessInfo_v3_t) == 24
        v1 = (V1 * 3)()
        count = ctypes.c_uint(3)
        ret = pynvml.nvmlLib.nvmlDeviceGetComputeRunningProcesses(gpu(0), ctypes.byref(count), v1)
        out["v1"] = [ret, count.value, [[p.pid, p.usedGpuMemory] for p in v1]]
    ''')
    assert got["probe"] == [pynvml.NVML_ERROR_INSUFFICIENT_SIZE, 3]
    assert got["null_with_count"] == pynvml.NVML_ERROR_INVALID_ARGUMENT
    assert got["null_count"] == pynvml.NVML_ERROR_INVALID_ARGUMENT
    assert got["short"] == [pynvml.NVML_ERROR_INSUFFICIENT_SIZE, 3, a, b, 0]
    assert got["enough"] == [0, 3, [a, b, c, 0]]
    assert got["v1"] == [0, 3, [[a, 10], [b, 20], [c, 30]]]


def test_mig_devices_list_their_own_processes(tmp_path: Path, sleepers: list[int]) -> None:
    """A MIG device handle lists its instance's processes; the parent the aggregate, to root only."""
    host = create_host(tmp_path / "host", gpus=2, mig={0: ("1g.10gb", "3g.40gb")})
    first, second = host.mig_devices
    a, b, c = sleepers
    host.set_gpu_processes(
        [(0, a, 100, first.gi, first.ci), (0, b, 200, second.gi, second.ci), (0, c, 300, second.gi, second.ci),
         (1, c, 400)]
    )
    got = run(host, '''
        migs = [pynvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu(0), i) for i in range(2)]
        out["migs"] = [compute(m) for m in migs]
        out["parent"] = compute(gpu(0))
        out["other"] = compute(gpu(1))
        out["mig_graphics"] = code(pynvml.nvmlDeviceGetGraphicsRunningProcesses, migs[0])
        os.seteuid(65534)
        out["parent_unprivileged"] = code(pynvml.nvmlDeviceGetComputeRunningProcesses, gpu(0))
        os.seteuid(0)
    ''')
    one = [[a, 100, first.gi, first.ci]]
    two = [[b, 200, second.gi, second.ci], [c, 300, second.gi, second.ci]]
    assert got["migs"] == [one, two]
    assert got["parent"] == one + two
    assert got["other"] == [[c, 400, NO_ID, NO_ID]]
    assert got["mig_graphics"] == pynvml.NVML_ERROR_NOT_SUPPORTED
    assert got["parent_unprivileged"] == pynvml.NVML_ERROR_NO_PERMISSION


def test_set_gpu_processes_checks_its_entries(tmp_path: Path) -> None:
    """Unknown GPUs, bad pids, instance ids off MIG (or missing in MIG mode) and graphics in MIG mode are refused."""
    host = create_host(tmp_path / "host", gpus=2, mig={0: ("1g.10gb",)})
    for entries, graphics in (
        ([(2, 1, 1)], []),
        ([(1, 0, 1)], []),
        ([(1, 1, -1)], []),
        ([(1, 1, 1, 0, 0)], []),
        ([(0, 1, 1)], []),
        ([(0, 1, 1, 15, 0)], []),
        ([], [(0, 1, 1)]),
    ):
        with pytest.raises(FakeHostError):
            host.set_gpu_processes(entries, graphics=graphics)
    assert not (host.root / "etc/mock-nvml/processes").exists()


def test_malformed_file_fails_the_call(host: FakeHost, sleepers: list[int]) -> None:
    """A line that does not parse is NVML_ERROR_UNKNOWN, loudly, not a silently shorter list."""
    (host.root / "etc/mock-nvml/processes").write_text(f"# a comment\n\n0 {sleepers[0]} 5\n0 {sleepers[1]}\n")
    got = run(host, 'out["ret"] = code(pynvml.nvmlDeviceGetComputeRunningProcesses, gpu(0))')
    assert got == {"ret": pynvml.NVML_ERROR_UNKNOWN}
