"""Corpus D: the hook's process context, its state on stdin and the bundle's config.json (security.md §4 D31-D39)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from .conftest import Progs
from .rig import GPU0, GPU_PROBE, HERE, HOOK_ENV, Outcome, Rig, hook_command, hook_entry, snapshot

FORGE = str(HERE / "forge.py")
D_TIMEOUT_S = 10.0


def forged(rig: Rig, *options: str) -> Outcome:
    """Run a GPU 0 container whose hook is gpuhook behind forge.py with *options*."""
    hook = hook_entry(rig.base_config, wrapper=[FORGE, *options], via=rig.via)
    return rig.run(rig.container(GPU0, GPU_PROBE, hook=hook), timeout=D_TIMEOUT_S)


# --- D31/D32: the hook's own environment ----------------------------------------------------------------


@pytest.mark.parametrize("variable", ["LD_PRELOAD", "LD_AUDIT", "LD_LIBRARY_PATH"])
def test_nvidiascape_image_env_never_reaches_the_hook(rig: Rig, progs: Progs, variable: str) -> None:
    """D31: image env ``LD_*=/proc/self/cwd/poc.so`` (poc.so in the bundle, the hook's cwd) never runs; GPU works."""
    progs.marker.unlink(missing_ok=True)
    value = "/proc/self/cwd" if variable == "LD_LIBRARY_PATH" else "/proc/self/cwd/poc.so"

    def prepare(rootfs: Path) -> None:
        shutil.copy(progs.poc_so, rootfs.parent / "poc.so")
        shutil.copy(progs.poc_so, rootfs.parent / "libc.so.6")  # what LD_LIBRARY_PATH would pick up

    outcome = rig.run(rig.container({**GPU0, variable: value}, GPU_PROBE, prepare=prepare))
    assert not progs.marker.exists(), "poc.so ran in a process on the host"
    rig.check_gpu(outcome, [0])


@pytest.mark.parametrize("variable", ["LD_PRELOAD", "LD_AUDIT", "LD_LIBRARY_PATH"])
def test_hook_registered_with_ld_variables_refuses(rig: Rig, progs: Progs, variable: str) -> None:
    """D31 tripwire: a hook registered with ``LD_*`` in its env refuses to work ("... in the hook's environment")."""
    value = str(progs.noop_so.parent) if variable == "LD_LIBRARY_PATH" else str(progs.noop_so)
    hook = hook_entry(rig.base_config, env=[*HOOK_ENV, f"{variable}={value}"], via=rig.via)
    outcome = rig.run(rig.container(GPU0, hook=hook))
    outcome.assert_refused(variable, "environment")


PYTHON_HIJACKS = [  # relative paths: runc starts hooks in the bundle directory
    pytest.param("PYTHONPATH", ".", id="D32-PYTHONPATH"),
    pytest.param("PYTHONWARNINGS", "ignore::evil.W", id="D32-PYTHONWARNINGS"),
    pytest.param("PYTHONSTARTUP", "evil.py", id="D32-PYTHONSTARTUP"),
    pytest.param("PYTHONINSPECT", "1", id="D32-PYTHONINSPECT"),
    pytest.param("PYTHONHOME", ".", id="D32-PYTHONHOME"),
]


@pytest.mark.parametrize(("variable", "value"), PYTHON_HIJACKS)
def test_python_hijack_variables_are_ignored_and_refused(rig: Rig, variable: str, value: str) -> None:
    """D32: ``PYTHON*`` in the hook's env imports nothing from the bundle (cwd), and the hook refuses because of it."""
    owned = rig.outside / "python-owned"
    payload = f"open({str(owned)!r}, 'a').write('owned\\n')\nclass W(Warning): pass\n"

    def prepare(rootfs: Path) -> None:
        for name in ("json.py", "evil.py", "os.py", "encodings.py", "sitecustomize.py", "usercustomize.py"):
            (rootfs.parent / name).write_text(payload)

    hook = hook_entry(rig.base_config, env=[*HOOK_ENV, f"{variable}={value}", "HOME=."],
                      via=rig.via)
    outcome = rig.run(rig.container(GPU0, hook=hook, prepare=prepare))
    assert not owned.exists(), "attacker Python code ran in the hook"
    outcome.assert_refused(variable, "environment")


# --- D33: cwd -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cwd", ["rootfs", "deleted", "fd:host-marker-dir"],
                         ids=["D33-cwd-rootfs", "D33-cwd-deleted", "D33-cwd-procfd-host-dir"])
def test_hostile_cwd_gives_the_same_result(rig: Rig, cwd: str) -> None:
    """D33: cwd in R, a deleted dir, or a host dir via /proc/self/fd: same GPU (relative root.path from the bundle)."""
    mode = f"fd:{rig.victim}" if cwd.startswith("fd:") else cwd
    outcome = forged(rig, "--cwd", mode)
    rig.check_gpu(outcome, [0])
    assert sorted(p.name for p in rig.victim.iterdir()) == ["marker"]


# --- D35: pid -------------------------------------------------------------------------------------------


@pytest.fixture
def host_sleeper() -> Iterator[int]:
    """A live process in the host's mount namespace (what a reused pid would name)."""
    proc = subprocess.Popen(["sleep", "30"], cwd="/")
    yield proc.pid
    proc.kill()
    proc.wait()


@pytest.mark.parametrize(
    "pid",
    [
        pytest.param("@self", id="D35-own-pid"),
        pytest.param("1", id="D35-pid-1"),
        pytest.param("0", id="D35-pid-0"),
        pytest.param("-1", id="D35-negative"),
        pytest.param("true", id="D35-true"),
        pytest.param('"123"', id="D35-string"),
        pytest.param("1.5", id="D35-float"),
        pytest.param(str(2**64), id="D35-2-to-64"),
        pytest.param("@nan", id="D35-NaN"),
        pytest.param("@dead", id="D35-exited"),
        pytest.param("@host-sleeper", id="D35-reused-by-host-process"),
        pytest.param("@missing", id="D35-missing"),
    ],
)
def test_bad_state_pid_is_refused(rig: Rig, host_sleeper: int, pid: str) -> None:
    """D35: a state pid that is not a live process in another mount namespace is refused, naming the pid."""
    if pid == "@missing":
        options = ["--del", "pid"]
    else:
        options = ["--set", f"pid={host_sleeper if pid == '@host-sleeper' else pid}"]
    forged(rig, *options).assert_refused("NaN" if pid == "@nan" else "pid")  # NaN: refused as JSON, before any pid


# --- D36/D37: bundle and config.json --------------------------------------------------------------------


def _evil_bundle(rig: Rig, container_rootfs: Path, kind: str) -> Path:
    """A directory standing in for the bundle, whose config.json is hostile in the way *kind* says."""
    evil = rig.tmp / f"evil-{kind}"
    evil.mkdir()
    config = evil / "config.json"
    good = {"ociVersion": "1.0.2", "process": {"env": ["NVIDIA_VISIBLE_DEVICES=0"]},
            "root": {"path": str(container_rootfs)}}
    body = json.dumps(good)
    texts: dict[str, Callable[[], str]] = {
        "20MiB": lambda: body[:-1] + ', "pad": "' + "x" * (20 << 20) + '"}',
        "duplicate-keys": lambda: body[:-1] + ', "ociVersion": "1.0.2"}',
        "nan": lambda: body[:-1] + ', "x": NaN}',
        "surrogate-root-path": lambda: body.replace('"root": {"path": "', '"root": {"path": "\\ud800'),
        "surrogate-env": lambda: body.replace("NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_VISIBLE_DEVICES=0\\udc80"),
        "env-is-a-string": lambda: body.replace('["NVIDIA_VISIBLE_DEVICES=0"]', '"NVIDIA_VISIBLE_DEVICES=0"'),
        "env-entry-without-equals": lambda: body.replace('=0"]', '=0", "JUNK"]'),
        "deep-nesting": lambda: body[:-1] + ', "x": ' + "[" * 100_000 + "]" * 100_000 + "}",
    }
    if kind == "symlink-to-host-file":
        plausible = rig.outside / "plausible-config.json"  # following the link would inject the GPU
        plausible.write_text(body)
        config.symlink_to(plausible)
    elif kind == "fifo":
        os.mkfifo(config)
    elif kind == "dev-zero":
        config.symlink_to("/dev/zero")
    elif kind == "invalid-utf8":
        config.write_bytes(body.encode()[:-1] + b', "x": "\xff\xfe"}')
    else:
        config.write_text(texts[kind]())
    return evil


@pytest.mark.parametrize(
    "bundle",
    [
        pytest.param("/", id="D36-bundle-slash"),
        pytest.param("/etc", id="D36-bundle-etc"),
        pytest.param("bundle0", id="D36-bundle-relative"),
        pytest.param("symlink-to-host-file", id="D36-config-symlink-to-host-file"),
        pytest.param("fifo", id="D36-config-fifo"),
        pytest.param("20MiB", id="D36-config-20MiB"),
        pytest.param("dev-zero", id="D37-config-dev-zero"),
        pytest.param("invalid-utf8", id="D37-invalid-utf8"),
        pytest.param("duplicate-keys", id="D37-duplicate-keys"),
        pytest.param("nan", id="D37-NaN"),
        pytest.param("surrogate-root-path", id="D37-lone-surrogate-in-root-path"),
        pytest.param("surrogate-env", id="D37-lone-surrogate-in-env"),
        pytest.param("env-is-a-string", id="D37-env-is-a-string"),
        pytest.param("env-entry-without-equals", id="D37-env-entry-without-equals"),
        pytest.param("deep-nesting", id="D37-100k-deep-nesting"),
    ],
)
def test_forged_bundle_is_refused(rig: Rig, bundle: str) -> None:
    """D36/D37: a state bundle that is not the container's, or a hostile config.json, is refused with a message."""
    rootfs_of_next_container = rig.tmp / "bundle0" / "rootfs"
    if bundle.startswith("/") or bundle.startswith("bundle"):
        value, needle = bundle, ("config.json" if bundle.startswith("/") else bundle)
    else:
        value = str(_evil_bundle(rig, rootfs_of_next_container, bundle))
        needle = "NVIDIA_VISIBLE_DEVICES" if bundle == "surrogate-env" else "config.json"
    outcome = forged(rig, "--set", f"bundle={json.dumps(value)}")
    assert rig.rootfses == [rootfs_of_next_container]
    outcome.assert_refused(needle)


# --- D38: stdin -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        pytest.param(["--raw", ""], id="D38-empty"),
        pytest.param(["--raw", "this is not JSON"], id="D38-not-json"),
        pytest.param(["--raw", "[]"], id="D38-json-array"),
        pytest.param(["--stdin", "hang"], id="D38-never-closed"),
        pytest.param(["--stdin", "huge"], id="D38-endless"),
    ],
)
def test_hostile_stdin_is_refused(rig: Rig, options: list[str]) -> None:
    """D38: an empty, non-JSON, never-closed or endless state on stdin is refused in bounded time."""
    forged(rig, *options).assert_refused("stdin")


# --- D39: outside a runtime -----------------------------------------------------------------------------


def _world_readable(path: Path) -> None:
    """Let uid 65534 reach *path* (the test's tmp tree is 0700)."""
    for p in (path, *path.parents):
        if p == Path("/tmp"):
            break
        p.chmod(p.stat().st_mode | 0o755)


def test_run_by_hand_as_nobody_is_refused(rig: Rig, host_sleeper: int) -> None:
    """D39: ``gpuhook prestart`` run by hand as uid 65534 with a plausible state is refused with a message."""
    container = rig.container(GPU0)
    config = rig.config(log_file=None)
    _world_readable(container.bundle)
    _world_readable(config)
    state = json.dumps({"ociVersion": "1.0.2", "id": "by-hand", "status": "creating", "pid": host_sleeper,
                        "bundle": str(container.bundle)})
    before = rig.host_state()
    proc = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--",
         *hook_command(config, via=rig.via)],
        input=state, capture_output=True, text=True, timeout=D_TIMEOUT_S, env={"PATH": "/usr/bin:/bin"}, cwd="/",
        check=False)
    assert proc.returncode == 1 and proc.stderr.startswith("gpuhook: "), proc.stderr
    assert "Traceback" not in proc.stderr
    rig.assert_host_unchanged(before)


@pytest.fixture
def sandbox_sleeper(rig: Rig) -> Iterator[tuple[int, Path]]:
    """A sleeper in its own mount namespace whose root was pivoted into a scratch copy of the test rootfs.

    A hook that takes ``root.path: /`` and the pid at face value would write into this scratch
    root (outside every container rootfs, so the (o2) check sees it), never into the real host's /.
    """
    scratch = rig.tmp / "sandbox-root"
    shutil.copytree(rig.rootfs_src, scratch, symlinks=True)
    (scratch / "SANDBOX").write_text("sandbox\n")
    script = ('mount --bind "$S" "$S" && cd "$S" && mkdir .old && pivot_root . .old && '
              "/bin/busybox umount -l /.old && /bin/busybox rmdir /.old && exec /bin/sleep 30")
    proc = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script],
                            env={"S": str(scratch), "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}, cwd="/")
    try:
        for _ in range(200):  # until the sleeper's namespace root is the scratch dir
            probe = subprocess.run(["nsenter", "-t", str(proc.pid), "-m", "/bin/busybox", "cat", "/SANDBOX"],
                                   capture_output=True, text=True, check=False)
            if probe.stdout == "sandbox\n" and Path(f"/proc/{proc.pid}/cmdline").read_bytes().startswith(b"/bin/sleep"):
                break
            subprocess.run(["sleep", "0.02"], check=True)
        else:
            pytest.fail("could not build the sandbox sleeper")
        yield proc.pid, scratch
    finally:
        proc.kill()
        proc.wait()


def test_forged_rootfs_slash_is_refused(rig: Rig, sandbox_sleeper: tuple[int, Path]) -> None:
    """D39: a forged config.json with ``root.path: /`` (the namespace's whole root) is refused, nothing written."""
    pid, scratch = sandbox_sleeper
    evil = rig.tmp / "evil-root-slash"
    evil.mkdir()
    (evil / "config.json").write_text(json.dumps({
        "ociVersion": "1.0.2", "process": {"env": ["NVIDIA_VISIBLE_DEVICES=0"]}, "root": {"path": "/"}}))
    state = json.dumps({"ociVersion": "1.0.2", "id": "by-hand", "status": "creating", "pid": pid, "bundle": str(evil)})
    before = rig.host_state()
    scratch_before = snapshot(scratch)
    proc = subprocess.run(hook_command(rig.base_config, via=rig.via),
                          input=state, capture_output=True, text=True, timeout=D_TIMEOUT_S,
                          env={"PATH": "/usr/bin:/bin"}, cwd="/", check=False)
    assert snapshot(scratch) == scratch_before, "gpuhook wrote into the namespace's root"
    assert proc.returncode == 1 and proc.stderr.startswith("gpuhook: "), proc.stderr
    assert "Traceback" not in proc.stderr and "/" in proc.stderr
    rig.assert_host_unchanged(before)


def test_state_from_forge_is_well_formed(rig: Rig) -> None:
    """Control for the forgeries above: forge.py with no option hands gpuhook the real state, and the GPU works."""
    rig.check_gpu(forged(rig), [0])
