"""``gpuhook install``: what each engine's configuration must contain to use gpuhook (pure).

Every function takes the file's current text (or None) and returns the text it
should have; the CLI writes only what differs, keeps a backup, and says which
daemon to restart. Running it twice changes nothing the second time.
"""

from __future__ import annotations

import json
import re
import tomllib
from dataclasses import dataclass
from typing import Any, Final

from gpuhook.errors import ConfigError

ENGINES: Final = ("docker", "containerd", "podman", "crio")


@dataclass(frozen=True, slots=True, kw_only=True)
class Change:
    """One file (or symlink) the engine needs, its wanted content, and what to restart after."""

    path: str
    content: str | None = None  # the file's text, or None for a symlink
    link_to: str | None = None
    restart: str = ""
    mode: int = 0o644


#: The runtime name gpuhook registers by default; ``--name nvidia`` keeps NVIDIA users' ``--runtime nvidia``,
#: compose files' ``runtime: nvidia`` and RuntimeClass ``nvidia`` working.
DEFAULT_NAME: Final = "gpuhook"
_NAME_RE: Final = re.compile(r"[a-z][a-z0-9_-]{0,62}")


def check_name(name: str) -> str:
    """A runtime name docker, containerd and Kubernetes all accept (refused otherwise, naming it)."""
    if not _NAME_RE.fullmatch(name):
        raise ConfigError(f"--name {name!r}: expected a runtime name of lower-case letters, digits, '-' and '_' "
                          "(such as gpuhook or nvidia)")
    return name


def docker_daemon_json(current: str | None, runtime: str, *, name: str = DEFAULT_NAME, default: bool = False) -> str:
    """daemon.json with a *name* runtime entry added (other settings kept as they are); *default*: it
    becomes ``default-runtime``, so every container runs through it (NVIDIA's ``--set-as-default``)."""
    try:
        data: Any = json.loads(current) if current and current.strip() else {}
    except ValueError as err:
        raise ConfigError(f"/etc/docker/daemon.json is not valid JSON ({err}); fix it before installing") from err
    if not isinstance(data, dict):
        raise ConfigError("/etc/docker/daemon.json must hold a JSON object")
    runtimes = data.setdefault("runtimes", {})
    if not isinstance(runtimes, dict):
        raise ConfigError('/etc/docker/daemon.json: "runtimes" must be an object')
    runtimes[name] = {"path": runtime}
    if default:
        data["default-runtime"] = name
    return json.dumps(data, indent=2, sort_keys=True) + "\n"


CONTAINERD_CONFIG: Final = "/etc/containerd/config.toml"
CONTAINERD_DROPIN: Final = "/etc/containerd/conf.d/gpuhook.toml"
CONTAINERD_IMPORTS: Final = "/etc/containerd/conf.d/*.toml"
_IMPORTS_LINE: Final = re.compile(r"imports\s*=\s*\[(?P<items>[^\]]*)\]\s*(#.*)?")


def containerd_config(current: str | None) -> str:
    """config.toml with a top-level ``imports`` that reads the drop-in (other settings kept as they are).

    Debian's and most distributions' config.toml have none, so containerd never reads conf.d:
    the line goes after ``version = ...`` (top-level keys must come before the first table); an
    existing one-line ``imports = [...]`` gets the glob appended.
    """
    if not current or not current.strip():
        return f'version = 2\nimports = ["{CONTAINERD_IMPORTS}"]\n'
    try:
        imports = tomllib.loads(current).get("imports", [])
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{CONTAINERD_CONFIG} is not valid TOML ({err}); fix it before installing") from err
    if not isinstance(imports, list):
        raise ConfigError(f"{CONTAINERD_CONFIG}: imports must be a list of paths")
    if CONTAINERD_IMPORTS in imports or CONTAINERD_DROPIN in imports:
        return current
    lines = current.splitlines(keepends=True)
    top = next((n for n, line in enumerate(lines) if line.lstrip().startswith("[")), len(lines))
    at = next((n for n in range(top) if lines[n].lstrip().startswith("imports")), None)
    if at is not None:
        match = _IMPORTS_LINE.fullmatch(lines[at].strip())
        if match is None:
            raise ConfigError(f'{CONTAINERD_CONFIG}: its imports spans several lines; add "{CONTAINERD_IMPORTS}" '
                              "to it by hand, then run this again")
        items = match["items"].strip().rstrip(",")
        lines[at] = f'imports = [{items + ", " if items else ""}"{CONTAINERD_IMPORTS}"]\n'
    else:
        version = next((n for n in range(top) if lines[n].lstrip().startswith("version")), None)
        at = version + 1 if version is not None else 0
        lines.insert(at, f'imports = ["{CONTAINERD_IMPORTS}"]\n')
    if lines[at - 1:at] and not lines[at - 1].endswith("\n"):
        lines[at - 1] += "\n"
    updated = "".join(lines)
    assert CONTAINERD_IMPORTS in tomllib.loads(updated)["imports"]  # a top-level key, as containerd reads it
    return updated


def containerd_dropin(runtime: str, *, name: str = DEFAULT_NAME, default: bool = False) -> str:
    """A containerd 1.6+ config drop-in registering a *name* CRI runtime handler (runc wrapper); *default*:
    it becomes the CRI plugin's ``default_runtime_name``."""
    cri = '[plugins."io.containerd.grpc.v1.cri".containerd'
    return (
        f'# Written by `gpuhook install --runtime containerd`: a CRI runtime handler "{name}" whose\n'
        "# shim runs gpuhook-runtime (a runc wrapper that puts the requested GPUs into the spec).\n"
        '# /etc/containerd/config.toml imports it: imports = ["/etc/containerd/conf.d/*.toml"]\n'
        "version = 2\n\n"
        + (f'{cri}]\n  default_runtime_name = "{name}"\n\n' if default else "")
        + f'{cri}.runtimes.{name}]\n'
        '  runtime_type = "io.containerd.runc.v2"\n'
        f'  {cri}.runtimes.{name}.options]\n'
        f'    BinaryName = "{runtime}"\n'
    )


#: The hooks.d file of each stage gpuhook registers: schema 1.0.0 runs one entry's ``args`` for
#: every stage it lists, and the hook learns its stage from its last argument, so each stage needs
#: a file of its own. ``prestart`` gives a container its GPUs; ``poststop`` releases the GPUs' lease
#: when the container is deleted.
HOOKS_D_FILES: Final = {"prestart": "gpuhook.json", "poststop": "gpuhook-poststop.json"}
PODMAN_HOOKS_D: Final = "/usr/share/containers/oci/hooks.d"
CRIO_HOOKS_D: Final = "/etc/containers/oci/hooks.d"


def hooks_d_json(hook: str, stage: str = "prestart") -> str:
    """The OCI hooks.d entry (schema 1.0.0) podman and CRI-O read: absolute path, explicit env.

    ``when: always`` for every stage: the poststop of a container that holds no lease is as cheap
    as the prestart of one that asks for no GPU, and no narrower ``when`` rule can see the
    environment variables that asked for the GPUs.
    """
    entry = {
        "version": "1.0.0",
        "hook": {"path": hook, "args": [hook.rsplit("/", 1)[-1], stage],
                 "env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"]},
        "when": {"always": True},
        "stages": [stage],
    }
    return json.dumps(entry, indent=2) + "\n"


def hooks_d_changes(directory: str, hook: str, *, restart: str = "") -> tuple[Change, ...]:
    """One hooks.d file per stage in HOOKS_D_FILES (prestart's first), all running *hook*."""
    return tuple(Change(path=f"{directory}/{name}", content=hooks_d_json(hook, stage), restart=restart)
                 for stage, name in HOOKS_D_FILES.items())


def launcher_script(python: str) -> str:
    """The hook launcher (as packaging/gpuhook-hook): isolated interpreter, no runpy."""
    return (
        f"#!{python} -I\n"
        '"""gpuhook\'s hook launcher (written by `gpuhook install`): python -I, no runpy."""\n\n'
        "from gpuhook.cli import main\n\n"
        "raise SystemExit(main())\n"
    )


def changes(engine: str, *, bin_dir: str, current: dict[str, str | None], python: str = "",
            relay: bool = False, name: str = DEFAULT_NAME, default: bool = False) -> tuple[Change, ...]:
    """Everything *engine* needs, given the current text of the files involved (by path).

    *relay*: gpuhook-relay is installed in *bin_dir*, and under NVIDIA's hook name in the libexec
    directory beside it (the packages' layout); hooks.d and docker ``--gpus`` then run those, which
    run the Python hook only when gpuhookd does not serve a call.
    """
    runtime, launcher = f"{bin_dir}/gpuhook-runtime", f"{bin_dir}/gpuhook-hook"
    hook_launcher = (Change(path=launcher, content=launcher_script(python), mode=0o755),) if python else ()
    nvidia_hook = f"{bin_dir}/nvidia-container-runtime-hook"
    if relay:
        launcher, hook_launcher = f"{bin_dir}/gpuhook-relay", ()
        nvidia_hook = f"{bin_dir.rsplit('/', 1)[0]}/libexec/nvidia-container-runtime-hook"
    if engine == "docker":
        path = "/etc/docker/daemon.json"
        return (
            Change(path=path, content=docker_daemon_json(current.get(path), runtime, name=name, default=default),
                   restart="dockerd (systemctl restart docker)"),
            # `docker run --gpus` looks the NVIDIA hook name up on dockerd's PATH at start-up.
            Change(path="/usr/local/bin/nvidia-container-runtime-hook", link_to=nvidia_hook,
                   restart="dockerd (systemctl restart docker)"),
        )
    if engine == "containerd":
        return (
            Change(path=CONTAINERD_DROPIN, content=containerd_dropin(runtime, name=name, default=default),
                   restart="containerd (systemctl restart containerd)"),
            Change(path=CONTAINERD_CONFIG, content=containerd_config(current.get(CONTAINERD_CONFIG)),
                   restart="containerd (systemctl restart containerd)"),
            # `ctr run --gpus` runs nvidia-container-cli from ctr's PATH.
            Change(path="/usr/local/bin/nvidia-container-cli", link_to=f"{bin_dir}/nvidia-container-cli"),
        )
    if engine in ("podman", "crio") and (name != DEFAULT_NAME or default):
        raise ConfigError(f"--name and --set-as-default name a runtime for docker and containerd; {engine} runs "
                          "gpuhook through its hooks.d files for every container, under no runtime name")
    if engine == "podman":
        return (*hook_launcher, *hooks_d_changes(PODMAN_HOOKS_D, launcher))
    if engine == "crio":
        return (*hook_launcher, *hooks_d_changes(CRIO_HOOKS_D, launcher, restart="crio (systemctl restart crio)"))
    raise ConfigError(f"unknown engine {engine!r}; expected one of {', '.join(ENGINES)}")
