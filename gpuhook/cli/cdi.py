"""``gpuhook cdi generate`` / ``cdi list``: the host's GPUs as a CDI spec; ``cdi-hook``: its createContainer hook."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from gpuhook import service
from gpuhook.cdi import Rendered
from gpuhook.cli.bundle import read_spec
from gpuhook.config import resolve_config_path
from gpuhook.errors import ConfigError, UsageError
from gpuhook.hookcall import read_bounded
from gpuhook.oci.state import parse_state
from gpuhook.oci.strictjson import STATE_LIMIT
from gpuhook.planning.paths import container_path
from gpuhook.sys import files


def run_cdi_generate(config_arg: str | None, debug: bool, env: Mapping[str, str], *, output: str | None,
                     fmt: str | None) -> int:
    """Write the spec to *output* (atomically) or stdout, as YAML or JSON (default: from the file name, else YAML)."""
    rendered = service.render_cdi(service.load_settings(config_arg, debug, env), hook_argv(config_arg, env))
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
    for name in service.render_cdi(service.load_settings(config_arg, debug, env), None).names:
        print(name)
    return 0


def encode(rendered: Rendered, fmt: str) -> str:
    """The spec as YAML (PyYAML ``safe_dump``, field order kept) or indented JSON."""
    if fmt == "json":
        return json.dumps(rendered.spec, indent=2) + "\n"
    import yaml

    return str(yaml.safe_dump(rendered.spec, sort_keys=False, default_flow_style=False))


def hook_argv(config_arg: str | None, env: Mapping[str, str]) -> list[str]:
    """This interpreter in isolated mode, and the same config file the spec was generated from."""
    path, explicit = resolve_config_path(config_arg, env)
    # the runtime runs the hook with only the spec's env: $GPUHOOK_CONFIG would not reach it
    config = ["--config", str(path.absolute())] if explicit else []
    return [os.path.abspath(sys.executable), "-I", "-m", "gpuhook", *config]


def run_update_ldcache(config_arg: str | None, debug: bool, stdin_fd: int, env: Mapping[str, str],
                       folders: Sequence[str]) -> int:
    """createContainer hook: run the host's ldconfig over *folders* in the container's rootfs."""
    try:
        dirs = [container_path(folder) for folder in folders]
    except ValueError as err:  # the spec that names this hook was edited by hand, or is not gpuhook's
        raise UsageError(f"--folder: {err}") from err
    config = service.load_settings(config_arg, debug, env)
    state = parse_state(read_bounded(stdin_fd, limit=STATE_LIMIT))
    service.update_ldcache_in(config, read_spec(state.bundle).rootfs, dirs)
    return 0


def _write_atomically(path: Path, text: str) -> None:
    """Write via a temporary file in the same directory and rename: a watching runtime never reads half a spec."""
    try:
        _make_parents(path)
        files.replace_file(path, text.encode(), mode=0o644)
    except OSError as err:
        raise ConfigError(f"cannot write the CDI spec {path}: {err.strerror or err}") from err


def _make_parents(path: Path) -> None:
    """Create the missing directories above *path* with mode 0755 whatever the umask: /var/run/cdi is on a
    tmpfs, gone after each boot, and every engine (running as another user, for rootless podman) must read it."""
    missing = [d for d in (path.parent, *path.parent.parents) if not d.is_dir()]
    for directory in reversed(missing):
        try:
            directory.mkdir(mode=0o755)
        except FileExistsError:
            if not directory.is_dir():
                raise
            continue  # made meanwhile (another generate at boot): its mode is its maker's
        directory.chmod(0o755)  # mkdir's mode is masked by the umask
