"""``gpuhook install --runtime ENGINE [--dry-run] [--root DIR]`` (and ``nvidia-ctk runtime configure``): register
gpuhook with an engine."""

from __future__ import annotations

import difflib
import json
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from gpuhook.errors import ConfigError
from gpuhook.install import (
    CONTAINERD_CONFIG,
    DOCKER_CONFIG,
    ENGINE_CONFIGS,
    Change,
    changes,
    check_name,
    registration,
)
from gpuhook.sys import files


def _target(root: Path, path: str) -> Path:
    """*path* under *root* (``/`` on a real host; a scratch dir in tests)."""
    return root / path.lstrip("/")


def _read(path: Path) -> str | None:
    """A file's text, or None when it does not exist."""
    try:
        return path.read_text()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"cannot read {path}: {getattr(err, 'strerror', None) or err}; expected the engine's "
                          "config file (a text file) or no file there") from err


def runtime_program(bin_dir: Path) -> Path:
    """The runc wrapper to register: its C front-end in libexec beside *bin_dir* (the packages' layout: no
    interpreter but for a GPU container's create), else the Python wrapper in *bin_dir*."""
    front_end = bin_dir.parent / "libexec" / "gpuhook-runtime"
    return front_end if front_end.is_file() else bin_dir / "gpuhook-runtime"


def has_relays(bin_dir: Path) -> bool:
    """Whether gpuhook-relay is installed in *bin_dir* and under NVIDIA's names in libexec beside it (the
    packages' layout; integration/relay.py makes it too)."""
    libexec = bin_dir.parent / "libexec"
    relays = (bin_dir / "gpuhook-relay", libexec / "nvidia-container-runtime-hook", libexec / "nvidia-container-cli")
    return all(path.is_file() for path in relays)


def run_install(engine: str, *, dry_run: bool, root: Path, bin_dir: Path, python: str = "",
                name: str | None = None, default: bool = False) -> int:
    """Print (and unless --dry-run, make) the changes; say what to restart."""
    paths = (DOCKER_CONFIG, CONTAINERD_CONFIG)
    current = {p: _read(_target(root, p)) for p in paths}
    wanted = changes(engine, bin_dir=str(bin_dir), current=current, python=python, relay=has_relays(bin_dir),
                     runtime=str(runtime_program(bin_dir)), name=None if name is None else check_name(name),
                     default=default)
    return _make(engine, wanted, root=root, dry_run=dry_run, diff=True)


def run_configure(engine: str, *, runtime: Path, config: Path | None, dropin: Path | None, name: str,
                  default: bool, dry_run: bool) -> int:
    """``nvidia-ctk runtime configure``: register *runtime* as handler *name* in *config* (the engine's
    config file, default ENGINE_CONFIGS) and nothing else; prints the files written and what to restart
    (the diff only with --dry-run, which changes nothing)."""
    path = str(config) if config is not None else ENGINE_CONFIGS.get(engine)
    current = {path: _read(Path(path))} if path else {}
    wanted = registration(engine, runtime=str(runtime), current=current, name=check_name(name), default=default,
                          config=path, dropin=None if dropin is None else str(dropin))
    return _make(engine, wanted, root=Path("/"), dry_run=dry_run, diff=dry_run)


def _make(engine: str, wanted: Sequence[Change], *, root: Path, dry_run: bool, diff: bool) -> int:
    """Show (*diff*) and unless *dry_run* write each change that differs from what is there; say what to restart."""
    todo = [c for c in wanted if _differs(root, c)]
    if not todo:
        print(f"gpuhook is already registered with {engine}; nothing to change")
        return 0
    for change in todo:
        if diff:
            _show(root, change)
        if not dry_run:
            _apply(root, change)
            if not diff:
                print(f"wrote {change.path}" if change.link_to is None else f"linked {change.path}")
    restarts = sorted({c.restart for c in todo if c.restart})
    verb = "would change" if dry_run else "changed"
    print(f"{verb} {len(todo)} file(s)" + (f"; restart {', '.join(restarts)}" if restarts and not dry_run else ""))
    return 0


def _differs(root: Path, change: Change) -> bool:
    """Whether the file or link is not yet what *change* wants."""
    path = _target(root, change.path)
    if change.link_to is not None:
        return not path.is_symlink() or os.readlink(path) != change.link_to
    current = _read(path)
    if current is not None and change.content is not None and change.path.endswith(".json"):
        # A JSON file that says the same (a package's own hooks.d file, formatted its way) is left alone.
        try:
            return bool(json.loads(current) != json.loads(change.content))
        except ValueError:
            return True
    return current != change.content


def _show(root: Path, change: Change) -> None:
    """A unified diff (or the link) of one change."""
    path = _target(root, change.path)
    if change.link_to is not None:
        print(f"link {change.path} -> {change.link_to}")
        return
    old = (_read(path) or "").splitlines(keepends=True)
    sys.stdout.writelines(difflib.unified_diff(old, (change.content or "").splitlines(keepends=True),
                                               fromfile=change.path, tofile=change.path))


def _apply(root: Path, change: Change) -> None:
    """Write one change atomically, keeping a backup of what was there."""
    try:
        _write(_target(root, change.path), change)
    except OSError as err:
        raise ConfigError(f"cannot write {change.path}: {err.strerror or err}; nothing after it was changed "
                          "(run it again once fixed: what is done already is kept)") from err


def _write(path: Path, change: Change) -> None:
    """Write *change* at *path*, keeping a backup of what was there."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() or path.is_symlink():
        backup = path.with_name(path.name + ".gpuhook-backup")
        if not backup.exists():
            shutil.copy2(path, backup, follow_symlinks=False)
    if change.link_to is not None:
        tmp = path.with_name(f".{path.name}.gpuhook-tmp")
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(change.link_to)
        tmp.replace(path)
        return
    files.replace_file(path, (change.content or "").encode(), mode=change.mode)
