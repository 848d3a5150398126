"""``gpuhook config show`` and ``gpuhook config import``: the effective settings, NVIDIA's file as gpuhook.yaml."""

from __future__ import annotations

import dataclasses
import enum
import json
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from gpuhook.config import (
    DEFAULT_PATH,
    NVIDIA_PATH,
    Config,
    LoadedConfig,
    Origin,
    build_config,
    read_config,
    resolve_config_path,
)
from gpuhook.errors import ConfigError
from gpuhook.sys import files

__all__ = ["render_import", "render_show", "run_config", "run_config_import", "run_config_show"]

#: A string YAML reads back as that same string without quotes (paths, level names, host:port).
_PLAIN: Final = re.compile(r"/[A-Za-z0-9_./-]*|[a-z][a-z0-9_.-]*(:[0-9]+)?")
_YAML_WORDS: Final = frozenset({"null", "true", "false", "yes", "no", "on", "off", "y", "n", "~"})


def run_config(args: Any, env: Mapping[str, str]) -> int:
    """``gpuhook config show|import``, from the parsed arguments."""
    if args.config_command == "show":
        return run_config_show(args.config, args.debug, env)
    return run_config_import(args.source, args.output, dry_run=args.dry_run, force=args.force)


def run_config_show(config_arg: str | None, debug: bool, env: Mapping[str, str]) -> int:
    """Print the effective configuration as gpuhook.yaml text, each key with where its value came from."""
    del debug  # nothing is logged: show reads, it does not act
    path, required = resolve_config_path(config_arg, env)
    sys.stdout.write(render_show(read_config(path, required=required)))
    return 0


def run_config_import(source: str | None, output: str | None, *, dry_run: bool, force: bool) -> int:
    """Write NVIDIA's config.toml (*source*) as the equivalent gpuhook.yaml (*output*); the unmapped keys on stderr."""
    source_path = Path(source) if source else NVIDIA_PATH
    output_path = Path(output) if output else DEFAULT_PATH
    loaded = read_config(source_path, required=True, nvidia=True)
    text = render_import(loaded)
    for notice in loaded.notices:
        print(f"gpuhook: {'warning' if notice.lost else 'note'}: {source_path}: {notice.render()}", file=sys.stderr)
    if dry_run:
        sys.stdout.write(text)
        return 0
    try:
        current: str | None = output_path.read_text(encoding="utf-8")
    except FileNotFoundError:
        current = None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"cannot read {output_path}: {getattr(err, 'strerror', None) or err}") from err
    if current == text:
        print(f"gpuhook: {output_path} already holds this configuration; nothing changed", file=sys.stderr)
        return 0
    if current is not None and not force:
        raise ConfigError(f"{output_path} exists and differs from what {source_path} gives; compare with "
                          "`gpuhook config import --dry-run`, then add --force to replace it")
    try:
        output_path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        files.replace_file(output_path, text.encode(), mode=0o644)
    except OSError as err:
        raise ConfigError(f"cannot write {output_path}: {err.strerror or err}") from err
    print(f"gpuhook: wrote {output_path} from {source_path}; gpuhook now reads it, not {source_path}", file=sys.stderr)
    return 0


def render_show(loaded: LoadedConfig) -> str:
    """Every setting as a gpuhook.yaml line, commented with its origin; NVIDIA's unmapped keys as comments."""
    where = f"{loaded.path}" if loaded.path else "no config file (the built-in defaults)"
    lines = [f"# gpuhook's effective configuration, from {where}",
             "# (each line: the value, and where it came from: gpuhook.yaml, NVIDIA's config.toml or default)"]
    lines += [f"# ignored: {notice.render()}" for notice in loaded.notices]
    defaults = Config()
    for field in dataclasses.fields(Config):
        name = field.name
        origin, detail = loaded.origins.get(name, (Origin.DEFAULT, ""))
        if name == "gpus" and name not in loaded.raw and loaded.config.device_policy is not None:
            lines.append(f"# gpus: from device_policy {loaded.config.device_policy}")
            continue
        value = loaded.raw[name] if name in loaded.raw else _as_yaml(getattr(defaults, name))
        note = origin.value if origin is Origin.DEFAULT or detail == name else f"{origin.value}: {detail}"
        lines.append(f"{name}: {_scalar(value)}  # {note}")
    return "\n".join(lines) + "\n"


def render_import(loaded: LoadedConfig) -> str:
    """The gpuhook.yaml that says what NVIDIA's file *loaded* says (only the keys it sets; the rest are defaults)."""
    build_config(loaded.raw, source="the imported settings")  # what is written must load (it was checked once)
    lines = [f"# gpuhook configuration imported from {loaded.path} by `gpuhook config import`.",
             "# The keys not set here are gpuhook's defaults, which equal NVIDIA's (see config/gpuhook.yaml)."]
    if loaded.notices:
        lines.append("# Keys of that file with no gpuhook effect:")
        lines += [f"#   {notice.render()}" for notice in loaded.notices]
    for name, value in loaded.raw.items():
        detail = loaded.origins.get(name, (Origin.DEFAULT, ""))[1]
        lines += [f"# from {detail}", f"{name}: {_scalar(value)}"]
    return "\n".join(lines) + "\n"


def _as_yaml(value: Any) -> Any:
    """A Config default as gpuhook.yaml spells it."""
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, frozenset):  # supported_driver_capabilities
        return sorted(str(item) for item in value)
    if dataclasses.is_dataclass(value):  # the sharing policy: no entries by default
        return []
    return value


def _scalar(value: Any) -> str:
    """*value* as one line of YAML that reads back as it (JSON's flow syntax where plain would not)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, str) and _PLAIN.fullmatch(value) and value.lower() not in _YAML_WORDS:
        return value
    return json.dumps(value)
