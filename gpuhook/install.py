"""``gpuhook install``: what each engine's configuration must contain to use gpuhook (pure).

Every function takes the file's current text (or None) and returns the text it
should have; the CLI writes only what differs, keeps a backup, and says which
daemon to restart. Running it twice changes nothing the second time.
"""

from __future__ import annotations

import json
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


def docker_daemon_json(current: str | None, runtime: str) -> str:
    """daemon.json with a ``gpuhook`` runtime entry added (other settings kept as they are)."""
    try:
        data: Any = json.loads(current) if current and current.strip() else {}
    except ValueError as err:
        raise ConfigError(f"/etc/docker/daemon.json is not valid JSON ({err}); fix it before installing") from err
    if not isinstance(data, dict):
        raise ConfigError("/etc/docker/daemon.json must hold a JSON object")
    runtimes = data.setdefault("runtimes", {})
    if not isinstance(runtimes, dict):
        raise ConfigError('/etc/docker/daemon.json: "runtimes" must be an object')
    runtimes["gpuhook"] = {"path": runtime}
    return json.dumps(data, indent=2, sort_keys=True) + "\n"


def containerd_dropin(runtime: str) -> str:
    """A containerd 1.6+ config drop-in registering a ``gpuhook`` CRI runtime handler (runc wrapper)."""
    return (
        '# Written by `gpuhook install --runtime containerd`: a CRI runtime handler "gpuhook" whose\n'
        "# shim runs gpuhook-runtime (a runc wrapper that puts the requested GPUs into the spec).\n"
        '# Import it from /etc/containerd/config.toml: imports = ["/etc/containerd/conf.d/*.toml"]\n'
        "version = 2\n\n"
        '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.gpuhook]\n'
        '  runtime_type = "io.containerd.runc.v2"\n'
        '  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.gpuhook.options]\n'
        f'    BinaryName = "{runtime}"\n'
    )


def hooks_d_json(hook: str) -> str:
    """The OCI hooks.d entry (schema 1.0.0) podman and CRI-O read: absolute path, explicit env."""
    entry = {
        "version": "1.0.0",
        "hook": {"path": hook, "args": [hook.rsplit("/", 1)[-1], "prestart"],
                 "env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"]},
        "when": {"always": True},
        "stages": ["prestart"],
    }
    return json.dumps(entry, indent=2) + "\n"


def launcher_script(python: str) -> str:
    """The hook launcher (as packaging/gpuhook-hook): isolated interpreter, no runpy."""
    return (
        f"#!{python} -I\n"
        '"""gpuhook\'s hook launcher (written by `gpuhook install`): python -I, no runpy."""\n\n'
        "from gpuhook.cli import main\n\n"
        "raise SystemExit(main())\n"
    )


def changes(engine: str, *, bin_dir: str, current: dict[str, str | None], python: str = "",
            relay: bool = False) -> tuple[Change, ...]:
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
            Change(path=path, content=docker_daemon_json(current.get(path), runtime),
                   restart="dockerd (systemctl restart docker)"),
            # `docker run --gpus` looks the NVIDIA hook name up on dockerd's PATH at start-up.
            Change(path="/usr/local/bin/nvidia-container-runtime-hook", link_to=nvidia_hook,
                   restart="dockerd (systemctl restart docker)"),
        )
    if engine == "containerd":
        return (
            Change(path="/etc/containerd/conf.d/gpuhook.toml", content=containerd_dropin(runtime),
                   restart="containerd (systemctl restart containerd)"),
            # `ctr run --gpus` runs nvidia-container-cli from ctr's PATH.
            Change(path="/usr/local/bin/nvidia-container-cli", link_to=f"{bin_dir}/nvidia-container-cli"),
        )
    if engine == "podman":
        return (*hook_launcher,
                Change(path="/usr/share/containers/oci/hooks.d/gpuhook.json", content=hooks_d_json(launcher)))
    if engine == "crio":
        return (*hook_launcher, Change(path="/etc/containers/oci/hooks.d/gpuhook.json", content=hooks_d_json(launcher),
                                       restart="crio (systemctl restart crio)"))
    raise ConfigError(f"unknown engine {engine!r}; expected one of {', '.join(ENGINES)}")
