"""``gpuhook doctor``'s engine part: ask each installed engine what it really runs (decisions in gpuhook.doctor).

containerd: ``containerd config dump`` (the files as containerd merges them, imports included; no
daemon needed). docker: ``docker info`` when dockerd runs (what it loaded), else daemon.json.
podman: its hooks dirs, compared with gpuhook's hooks.d files by JSON content. CRI-O: its hooks
dirs and crio.conf(.d) runtimes. Each command runs with a clean environment and a timeout; an engine
that cannot be asked is a warning, never a traceback.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tomllib
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from gpuhook.cli.install import has_relays
from gpuhook.cli.runtime import RUNTIME_PATH
from gpuhook.doctor import EngineView, containerd_runtimes, docker_runtimes
from gpuhook.install import CRIO_CONFIG, CRIO_HOOKS_D, DOCKER_CONFIG, PODMAN_HOOKS_D, changes

TIMEOUT_S = 10.0
#: The engine commands' whole environment: nothing of the caller's (a DOCKER_HOST, a CONTAINERD_*) leaks in.
CLEAN_ENV = {"PATH": RUNTIME_PATH, "LC_ALL": "C"}
#: How much of a runtime executable is read to tell whether it is gpuhook's.
_SNIFF_LIMIT = 8 << 20
DOCKER_SOCKET = Path("/var/run/docker.sock")
CONTAINERS_CONFS = (Path("/usr/share/containers/containers.conf"), Path("/etc/containers/containers.conf"))


def is_gpuhooks(program: str, *, path: str = RUNTIME_PATH) -> bool:
    """Whether *program* (a path, or a name looked up on the engines' PATH) is one of gpuhook's executables:
    gpuhook-runtime by name, or a file (script or binary) that says ``gpuhook`` (NVIDIA's do not)."""
    if not program:
        return False
    if program.rsplit("/", 1)[-1] == "gpuhook-runtime":
        return True
    found = program if "/" in program else shutil.which(program, path=path)
    try:
        with open(found or program, "rb") as file:
            return b"gpuhook" in file.read(_SNIFF_LIMIT)
    except OSError:
        return False


def _run(argv: Sequence[str]) -> tuple[int, str, str]:
    """Run an engine command (clean env, timeout): (status, stdout, a one-line reason for a failure)."""
    try:
        done = subprocess.run(argv, env=CLEAN_ENV, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return 124, "", f"`{' '.join(argv)}` did not answer within {TIMEOUT_S:.0f} s"
    except OSError as err:
        return 127, "", f"`{' '.join(argv)}`: {err.strerror or err}"
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    reason = f"`{' '.join(argv)}` exited {done.returncode}: {lines[-1] if lines else 'no message'}"
    return done.returncode, done.stdout, reason if done.returncode else ""


def containerd_view(binary: str | None, *, config: Path | None = None) -> EngineView:
    """containerd's runtime handlers as ``containerd [--config X] config dump`` merges them."""
    if binary is None:
        return EngineView(engine="containerd", installed=False)
    argv = [binary, *(("--config", str(config)) if config else ()), "config", "dump"]
    status, out, why = _run(argv)
    if status:
        return EngineView(engine="containerd", installed=True, error=why)
    try:
        runtimes = containerd_runtimes(out)
    except ValueError as err:
        return EngineView(engine="containerd", installed=True, error=f"its config dump is not TOML ({err})")
    ours = tuple(f"runtime handler {name} ({binary_name})" for name, binary_name in sorted(runtimes.items())
                 if is_gpuhooks(binary_name))
    return EngineView(engine="containerd", installed=True, handlers=ours, source="containerd config dump")


def docker_view(dockerd: str | None, *, client: str | None, daemon_json: Path = Path(DOCKER_CONFIG),
                host: str | None = None, gpus_hook: str | None = None) -> EngineView:
    """dockerd's runtimes as ``docker info`` reports them when dockerd answers, else as daemon.json has them;
    *gpus_hook* is the nvidia-container-runtime-hook on dockerd's PATH (what ``--gpus`` runs)."""
    if dockerd is None:
        return EngineView(engine="docker", installed=False)
    view = _docker_runtimes_view(client, daemon_json, host)
    if gpus_hook is not None and is_gpuhooks(gpus_hook):
        hook = f"--gpus hook {gpus_hook}"
        return replace(view, handlers=(*view.handlers, hook), source=view.source or "dockerd's PATH")
    return view


def _docker_runtimes_view(client: str | None, daemon_json: Path, host: str | None) -> EngineView:
    """The runtimes part of docker_view."""
    try:
        configured = docker_runtimes(daemon_json.read_text())
    except FileNotFoundError:
        configured = {}
    except (OSError, ValueError) as err:
        return EngineView(engine="docker", installed=True, error=f"{daemon_json}: {err}")
    written = tuple(sorted(name for name, path in configured.items() if is_gpuhooks(path)))
    running = host is not None or DOCKER_SOCKET.is_socket()
    if client is not None and running:
        status, out, _ = _run([client, *(("-H", host) if host else ()), "info", "--format", "{{json .Runtimes}}"])
        try:
            loaded = docker_runtimes(out) if status == 0 else None
        except ValueError:
            loaded = None
        if loaded is not None:
            ours = tuple(f"runtime {name} ({path})" for name, path in sorted(loaded.items()) if is_gpuhooks(path))
            return EngineView(engine="docker", installed=True, handlers=ours, source="docker info",
                              pending=tuple(name for name in written if name not in loaded))
    return EngineView(engine="docker", installed=True, source=f"{daemon_json} (dockerd is not running)",
                      handlers=tuple(f"runtime {name} ({configured[name]})" for name in written))


def _hook_files(dirs: Sequence[Path]) -> dict[str, Any]:
    """Every hooks.d entry in *dirs* (path → parsed JSON; unreadable or invalid ones skipped, as the engines do)."""
    found: dict[str, Any] = {}
    for directory in dirs:
        for path in sorted(directory.glob("*.json")):
            try:
                found[str(path)] = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
    return found


def hooks_view(engine: str, installed: bool, dirs: Sequence[Path], *, bin_dir: Path) -> EngineView:
    """The hooks.d entries that run gpuhook: the very entries `gpuhook install` writes (by JSON content,
    not bytes), or a prestart entry whose program is gpuhook's."""
    if not installed:
        return EngineView(engine=engine, installed=False)
    wanted = [json.loads(c.content or "") for c in changes(engine, bin_dir=str(bin_dir), current={},
                                                          relay=has_relays(bin_dir)) if c.path.endswith(".json")]
    found = _hook_files(dirs)
    source = f"hooks dirs {', '.join(map(str, dirs))}"
    if all(entry in found.values() for entry in wanted):
        return EngineView(engine=engine, installed=True, source=source,
                          handlers=tuple(path for path, entry in found.items() if entry in wanted))
    ours = tuple(path for path, entry in found.items() if isinstance(entry, dict) and "prestart" in
                 entry.get("stages", ()) and is_gpuhooks(str(entry.get("hook", {}).get("path", ""))))
    names = {c.path.rsplit("/", 1)[-1] for c in changes(engine, bin_dir="", current={})}
    differs = tuple(path for path, entry in found.items()
                    if path.rsplit("/", 1)[-1] in names and path not in ours and entry not in wanted)
    return EngineView(engine=engine, installed=True, source=source, handlers=ours, differs=differs)


def podman_hooks_dirs(confs: Sequence[Path] = CONTAINERS_CONFS) -> tuple[Path, ...]:
    """podman's hooks dirs: containers.conf's ``[engine] hooks_dir`` (the last file that sets it), else its
    defaults (the package's dir and /etc's)."""
    dirs: tuple[Path, ...] = (Path(PODMAN_HOOKS_D), Path(CRIO_HOOKS_D))
    for conf in confs:
        try:
            value = tomllib.loads(conf.read_text()).get("engine", {}).get("hooks_dir")
        except (OSError, ValueError):
            continue
        if isinstance(value, list) and all(isinstance(item, str) for item in value):
            dirs = tuple(Path(item) for item in value)
    return dirs


def crio_view(binary: str | None, *, bin_dir: Path, config: Path = Path(CRIO_CONFIG)) -> EngineView:
    """CRI-O: a runtime in crio.conf or crio.conf.d that runs gpuhook, else gpuhook's hooks.d files."""
    if binary is None:
        return EngineView(engine="crio", installed=False)
    handlers = []
    for path in (config, *sorted(config.with_name("crio.conf.d").glob("*"))):
        try:
            runtimes = tomllib.loads(path.read_text()).get("crio", {}).get("runtime", {}).get("runtimes", {})
        except (OSError, ValueError):
            continue
        handlers += [f"runtime {name} ({path})" for name, entry in runtimes.items()
                     if isinstance(entry, dict) and is_gpuhooks(str(entry.get("runtime_path", "")))]
    if handlers:
        return EngineView(engine="crio", installed=True, handlers=tuple(handlers), source=f"{config}(.d)")
    return hooks_view("crio", True, (Path(CRIO_HOOKS_D), Path(PODMAN_HOOKS_D)), bin_dir=bin_dir)


def engine_views(bin_dir: Path) -> tuple[EngineView, ...]:
    """What docker, containerd, podman and CRI-O on this host see of gpuhook (gpuhook installed in *bin_dir*)."""
    def which(name: str) -> str | None:
        return shutil.which(name, path=RUNTIME_PATH)

    return (
        docker_view(which("dockerd"), client=which("docker"), gpus_hook=which("nvidia-container-runtime-hook")),
        containerd_view(which("containerd")),  # its own default config, /etc/containerd/config.toml
        hooks_view("podman", which("podman") is not None, podman_hooks_dirs(), bin_dir=bin_dir),
        crio_view(which("crio"), bin_dir=bin_dir),
    )
