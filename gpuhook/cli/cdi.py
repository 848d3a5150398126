"""``gpuhook cdi generate`` / ``cdi list``: the host's GPUs as a CDI spec; ``cdi-hook``: its createContainer hook."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import BinaryIO

from gpuhook import linux
from gpuhook.apply.ldconfig import open_ldconfig, run_ldconfig
from gpuhook.cdi import Rendered, render_spec
from gpuhook.cli.bundle import read_spec
from gpuhook.cli.common import load_settings, rootfs_identity
from gpuhook.cli.hygiene import check_environment
from gpuhook.cli.inputs import read_bounded
from gpuhook.config import Config, resolve_config_path
from gpuhook.discovery.cache import CachedDiscoverer
from gpuhook.discovery.host import HostDiscoverer
from gpuhook.errors import GpuHookError, SpecError
from gpuhook.oci.state import parse_state
from gpuhook.oci.strictjson import STATE_LIMIT
from gpuhook.planning.paths import container_path, libs32_dir, libs_dir
from gpuhook.planning.planner import Target


def run_cdi_generate(config_arg: str | None, debug: bool, env: Mapping[str, str], *, output: str | None,
                     fmt: str | None) -> int:
    """Write the spec to *output* (atomically) or stdout, as YAML or JSON (default: from the file name, else YAML)."""
    rendered = render_host(load_settings(config_arg, debug, env), hook_argv(config_arg, env))
    if fmt is None:
        fmt = "json" if output is not None and output.endswith(".json") else "yaml"
    text = encode(rendered, fmt)
    if output is None:
        sys.stdout.write(text)
    else:
        _write_atomically(Path(output), text)
    for item in rendered.not_covered:
        # the operator should know what a CDI container lacks compared with the hook
        print(f"gpuhook: note: a CDI container does not get {item} (the prestart hook does that)", file=sys.stderr)
    return 0


def run_cdi_list(config_arg: str | None, debug: bool, env: Mapping[str, str]) -> int:
    """Print the fully qualified device names, one a line."""
    for name in render_host(load_settings(config_arg, debug, env), None).names:
        print(name)
    return 0


def encode(rendered: Rendered, fmt: str) -> str:
    """The spec as YAML (PyYAML ``safe_dump``, field order kept) or indented JSON."""
    if fmt == "json":
        return json.dumps(rendered.spec, indent=2) + "\n"
    import yaml

    return str(yaml.safe_dump(rendered.spec, sort_keys=False, default_flow_style=False))


def render_host(config: Config, hook_argv: list[str] | None) -> Rendered:
    """Discover (through the inventory cache) and render, with Debian-layout library placement."""
    inventory = CachedDiscoverer(config=config, inner=HostDiscoverer(config), refresh=False).discover()
    machine = os.uname().machine
    # a spec is written before any image is known, so the image's layout cannot be looked at;
    # the Debian multiarch dir is on glibc's default search path in Debian/Ubuntu images (NVIDIA's
    # specs use the host's own paths, which is the same on a Debian host)
    target = Target(libs_dir=libs_dir(debian_like=True, machine=machine),
                    libs32_dir=libs32_dir(debian_like=True, machine=machine),
                    unhealthy_gpus="ignore")
    return render_spec(inventory, target, hook_argv)


def hook_argv(config_arg: str | None, env: Mapping[str, str]) -> list[str]:
    """This interpreter in isolated mode, and the same config file the spec was generated from."""
    path, explicit = resolve_config_path(config_arg, env)
    # the runtime runs the hook with only the spec's env: $GPUHOOK_CONFIG would not reach it
    config = ["--config", str(path.absolute())] if explicit else []
    return [os.path.abspath(sys.executable), "-I", "-m", "gpuhook", *config]


def run_update_ldcache(config_arg: str | None, debug: bool, stdin: BinaryIO, env: Mapping[str, str],
                       folders: Sequence[str]) -> int:
    """createContainer hook: run the host's ldconfig over *folders* in the container's rootfs.

    runc runs createContainer hooks in the container's mount namespace after its mounts and
    before pivot_root, so the rootfs path from config.json already shows the CDI mounts: the
    hook needs no setns, only the same sealed, sandboxed ldconfig as the prestart hook.
    """
    check_environment(env)
    config = load_settings(config_arg, debug, env)
    state = parse_state(read_bounded(stdin, limit=STATE_LIMIT))
    spec = read_spec(state.bundle)
    rootfs_identity(spec.rootfs)  # refuses the host's own /
    dirs = [container_path(folder) for folder in folders]
    ldconfig_fd = open_ldconfig(config.ldconfig)
    try:
        root_fd = os.open(spec.rootfs, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as err:
        os.close(ldconfig_fd)
        raise SpecError(f"cannot open the container rootfs {spec.rootfs}: {err.strerror}") from err
    # This hook already runs in the container's namespaces, where the host's cannot be told apart:
    # ldconfig joins ours (a no-op) and gets fresh network, IPC and UTS namespaces, always.
    own = os.pidfd_open(os.getpid())
    try:
        run_ldconfig(ldconfig_fd, root_fd, dirs, pidfd=own, timeout=config.timeout_seconds,
                     fresh=linux.CLONE_NEWNET | linux.CLONE_NEWIPC | linux.CLONE_NEWUTS)
    finally:
        os.close(own)
        os.close(root_fd)
        os.close(ldconfig_fd)
    return 0


def _write_atomically(path: Path, text: str) -> None:
    """Write via a temporary file in the same directory and rename: a watching runtime never reads half a spec."""
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as err:
        raise GpuHookError(f"cannot write the CDI spec into {path.parent}: {err.strerror}") from err
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except OSError as err:
        os.unlink(tmp)
        raise GpuHookError(f"cannot write the CDI spec {path}: {err.strerror}") from err
