"""``gpuhook install --runtime ENGINE [--dry-run] [--root DIR]``: register gpuhook with an engine."""

from __future__ import annotations

import difflib
import json
import os
import shutil
import sys
from pathlib import Path

from gpuhook.install import DEFAULT_NAME, Change, changes, check_name
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


def run_install(engine: str, *, dry_run: bool, root: Path, bin_dir: Path, python: str = "",
                name: str = DEFAULT_NAME, default: bool = False) -> int:
    """Print (and unless --dry-run, make) the changes; say what to restart."""
    paths = ("/etc/docker/daemon.json", "/etc/containerd/config.toml")
    current = {p: _read(_target(root, p)) for p in paths}
    relays = (bin_dir / "gpuhook-relay", bin_dir.parent / "libexec" / "nvidia-container-runtime-hook")
    relay = all(path.is_file() for path in relays)  # the packages' layout (integration/relay.py makes it too)
    wanted = changes(engine, bin_dir=str(bin_dir), current=current, python=python, relay=relay,
                     name=check_name(name), default=default)
    todo = [c for c in wanted if _differs(root, c)]
    if not todo:
        print(f"gpuhook is already registered with {engine}; nothing to change")
        return 0
    for change in todo:
        _show(root, change)
        if not dry_run:
            _apply(root, change)
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
    path = _target(root, change.path)
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
