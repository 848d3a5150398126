"""``gpuhook install``: what each engine's configuration must contain to use gpuhook (pure).

Every function takes the file's current text (or None) and returns the text it
should have; the CLI writes only what differs, keeps a backup, and says which
daemon to restart. Running it twice changes nothing the second time.
"""

from __future__ import annotations

import fnmatch
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


DOCKER_CONFIG: Final = "/etc/docker/daemon.json"


def docker_daemon_json(current: str | None, runtime: str, *, name: str = DEFAULT_NAME, default: bool = False,
                       path: str = DOCKER_CONFIG) -> str:
    """daemon.json (at *path*) with a *name* runtime entry added (other settings kept as they are); *default*:
    it becomes ``default-runtime``, so every container runs through it (NVIDIA's ``--set-as-default``)."""
    try:
        data: Any = json.loads(current) if current and current.strip() else {}
    except ValueError as err:
        raise ConfigError(f"{path} is not valid JSON ({err}); fix it before installing") from err
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    runtimes = data.setdefault("runtimes", {})
    if not isinstance(runtimes, dict):
        raise ConfigError(f'{path}: "runtimes" must be an object')
    runtimes[name] = {"path": runtime}
    if default:
        data["default-runtime"] = name
    return json.dumps(data, indent=2, sort_keys=True) + "\n"


CONTAINERD_CONFIG: Final = "/etc/containerd/config.toml"
CONTAINERD_DROPIN: Final = "/etc/containerd/conf.d/gpuhook.toml"
CONTAINERD_IMPORTS: Final = "/etc/containerd/conf.d/*.toml"
_IMPORTS_LINE: Final = re.compile(r"imports\s*=\s*\[(?P<items>[^\]]*)\]\s*(#.*)?")


def _parent(path: str) -> str:
    """The directory part of an absolute path (core does no I/O, so not os.path)."""
    return path.rsplit("/", 1)[0] or "/"


def containerd_dropin_path(config: str = CONTAINERD_CONFIG) -> str:
    """Where the drop-in goes for the config file *config*: conf.d beside it (/etc/containerd/conf.d/gpuhook.toml)."""
    return f"{_parent(config)}/conf.d/gpuhook.toml"


def _imports_entry(dropin: str) -> str:
    """What config.toml's imports gets for *dropin*: its directory's ``*.toml`` (so other drop-ins are read too)."""
    return f"{_parent(dropin)}/*.toml" if dropin.endswith(".toml") else dropin


def _imported(pattern: str, dropin: str, config: str) -> bool:
    """Whether one ``imports`` entry reads *dropin*: containerd resolves a relative entry against the config's
    directory and globs each entry within one directory."""
    if not pattern.startswith("/"):
        pattern = f"{_parent(config)}/{pattern}"
    return _parent(pattern) == _parent(dropin) and fnmatch.fnmatchcase(dropin.rsplit("/", 1)[-1],
                                                                        pattern.rsplit("/", 1)[-1])


def containerd_config(current: str | None, *, path: str = CONTAINERD_CONFIG, dropin: str = CONTAINERD_DROPIN) -> str:
    """config.toml (at *path*) with a top-level ``imports`` that reads *dropin* (other settings kept as they are).

    Debian's and most distributions' config.toml have none, so containerd never reads conf.d:
    the line goes after ``version = ...`` (top-level keys must come before the first table); an
    existing one-line ``imports = [...]`` gets the glob appended.
    """
    entry = _imports_entry(dropin)
    if not current or not current.strip():
        return f'version = 2\nimports = ["{entry}"]\n'
    try:
        imports = tomllib.loads(current).get("imports", [])
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path} is not valid TOML ({err}); fix it before installing") from err
    if not isinstance(imports, list) or not all(isinstance(item, str) for item in imports):
        raise ConfigError(f"{path}: imports must be a list of paths")
    if any(_imported(item, dropin, path) for item in imports):
        return current
    lines = current.splitlines(keepends=True)
    top = next((n for n, line in enumerate(lines) if line.lstrip().startswith("[")), len(lines))
    at = next((n for n in range(top) if lines[n].lstrip().startswith("imports")), None)
    if at is not None:
        match = _IMPORTS_LINE.fullmatch(lines[at].strip())
        if match is None:
            raise ConfigError(f'{path}: its imports spans several lines; add "{entry}" '
                              "to it by hand, then run this again")
        items = match["items"].strip().rstrip(",")
        lines[at] = f'imports = [{items + ", " if items else ""}"{entry}"]\n'
    else:
        version = next((n for n in range(top) if lines[n].lstrip().startswith("version")), None)
        at = version + 1 if version is not None else 0
        lines.insert(at, f'imports = ["{entry}"]\n')
    if lines[at - 1:at] and not lines[at - 1].endswith("\n"):
        lines[at - 1] += "\n"
    updated = "".join(lines)
    assert entry in tomllib.loads(updated)["imports"]  # a top-level key, as containerd reads it
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


CRIO_CONFIG: Final = "/etc/crio/crio.conf"
#: The engine config file each runtime registration edits (``nvidia-ctk runtime configure --config``'s default).
ENGINE_CONFIGS: Final = {"docker": DOCKER_CONFIG, "containerd": CONTAINERD_CONFIG, "crio": CRIO_CONFIG}


def crio_dropin_path(name: str, config: str = CRIO_CONFIG) -> str:
    """CRI-O's drop-in for runtime *name*, in the crio.conf.d beside *config*.

    Under NVIDIA's name it is NVIDIA's own file (99-nvidia.toml): CRI-O applies drop-ins in name
    order, so a 99-gpuhook.conf beside NVIDIA's would lose the ``nvidia`` handler to it.
    """
    return f"{_parent(config)}/crio.conf.d/" + ("99-nvidia.toml" if name == "nvidia" else "99-gpuhook.conf")


def crio_dropin(runtime: str, *, name: str = DEFAULT_NAME, default: bool = False) -> str:
    """A CRI-O drop-in registering an OCI runtime handler *name* that runs *runtime*; *default*: CRI-O's
    ``default_runtime``, so every pod without a RuntimeClass runs through it."""
    return (
        f'# Written by `gpuhook install --runtime crio --name {name}`: a runtime handler "{name}" that runs\n'
        "# gpuhook-runtime (a runc wrapper that puts the requested GPUs into the spec); a RuntimeClass\n"
        f'# with handler "{name}" selects it. Restart CRI-O to read it (systemctl restart crio).\n'
        + (f'[crio.runtime]\ndefault_runtime = "{name}"\n\n' if default else "")
        + f"[crio.runtime.runtimes.{name}]\n"
        f'runtime_path = "{runtime}"\n'
        'runtime_type = "oci"\n'
    )


def registration(engine: str, *, runtime: str, current: dict[str, str | None], name: str = DEFAULT_NAME,
                 default: bool = False, config: str | None = None, dropin: str | None = None) -> tuple[Change, ...]:
    """The engine config that registers a runtime handler *name* running *runtime* (and nothing else:
    what ``nvidia-ctk runtime configure`` edits). *config* is the engine's config file (ENGINE_CONFIGS
    by default), *dropin* the containerd/CRI-O drop-in (beside *config* by default)."""
    path = config or ENGINE_CONFIGS.get(engine, "")
    if engine == "docker":
        if dropin is not None:
            raise ConfigError(f"--drop-in-config {dropin!r}: docker has no drop-in files; its runtimes are in "
                              f"{path} (--config)")
        return (Change(path=path, content=docker_daemon_json(current.get(path), runtime, name=name, default=default,
                                                             path=path),
                       restart="dockerd (systemctl restart docker)"),)
    if engine == "containerd":
        dropin = dropin or (CONTAINERD_DROPIN if path == CONTAINERD_CONFIG else containerd_dropin_path(path))
        restart = "containerd (systemctl restart containerd)"
        return (Change(path=dropin, content=containerd_dropin(runtime, name=name, default=default), restart=restart),
                Change(path=path, content=containerd_config(current.get(path), path=path, dropin=dropin),
                       restart=restart))
    if engine == "crio":
        return (Change(path=dropin or crio_dropin_path(name, path),
                       content=crio_dropin(runtime, name=name, default=default),
                       restart="crio (systemctl restart crio)"),)
    expected = ", ".join(ENGINE_CONFIGS)
    if engine == "podman":
        raise ConfigError(f"--runtime podman: podman runs gpuhook through its hooks.d files, under no runtime name; "
                          f"a runtime is registered with {expected} (for podman: gpuhook install --runtime podman)")
    raise ConfigError(f"unknown engine {engine!r}; expected one of {', '.join(ENGINES)}")


def changes(engine: str, *, bin_dir: str, current: dict[str, str | None], python: str = "",
            relay: bool = False, runtime: str | None = None, name: str | None = None,
            default: bool = False) -> tuple[Change, ...]:
    """Everything *engine* needs, given the current text of the files involved (by path).

    *relay*: gpuhook-relay is installed in *bin_dir*, and under NVIDIA's hook and CLI names in the
    libexec directory beside it (the packages' layout); hooks.d, docker ``--gpus`` and ctr ``--gpus``
    then run those, which run the Python command only when gpuhookd does not serve a call.
    *runtime*: the runc wrapper to register (default *bin_dir*'s gpuhook-runtime). *name* (default
    gpuhook) is the runtime handler's name; for CRI-O, a *name* or *default* registers a runtime handler instead
    of the hooks.d files (never both: a container under that runtime would get gpuhook twice).
    """
    runtime, launcher = runtime or f"{bin_dir}/gpuhook-runtime", f"{bin_dir}/gpuhook-hook"
    hook_launcher = (Change(path=launcher, content=launcher_script(python), mode=0o755),) if python else ()
    nvidia_hook, nvidia_cli = f"{bin_dir}/nvidia-container-runtime-hook", f"{bin_dir}/nvidia-container-cli"
    if relay:
        launcher, hook_launcher = f"{bin_dir}/gpuhook-relay", ()
        libexec = f"{bin_dir.rsplit('/', 1)[0]}/libexec"
        nvidia_hook, nvidia_cli = f"{libexec}/nvidia-container-runtime-hook", f"{libexec}/nvidia-container-cli"
    handler = registration(engine, runtime=runtime, current=current, name=name or DEFAULT_NAME,
                           default=default) if engine in ENGINE_CONFIGS else ()
    if engine == "docker":
        return (
            *handler,
            # `docker run --gpus` looks the NVIDIA hook name up on dockerd's PATH at start-up.
            Change(path="/usr/local/bin/nvidia-container-runtime-hook", link_to=nvidia_hook,
                   restart="dockerd (systemctl restart docker)"),
        )
    if engine == "containerd":
        return (
            *handler,
            # `ctr run --gpus` runs nvidia-container-cli from ctr's PATH.
            Change(path="/usr/local/bin/nvidia-container-cli", link_to=nvidia_cli),
        )
    if engine == "podman" and (name is not None or default):
        raise ConfigError("--name and --set-as-default name a runtime for docker, containerd and crio; podman runs "
                          "gpuhook through its hooks.d files for every container, under no runtime name")
    if engine == "podman":
        return (*hook_launcher, *hooks_d_changes(PODMAN_HOOKS_D, launcher))
    if engine == "crio" and (name is not None or default):
        return handler
    if engine == "crio":
        return (*hook_launcher, *hooks_d_changes(CRIO_HOOKS_D, launcher, restart="crio (systemctl restart crio)"))
    raise ConfigError(f"unknown engine {engine!r}; expected one of {', '.join(ENGINES)}")
