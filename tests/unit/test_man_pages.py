"""The man pages in packaging/man/: each renders without a warning, and each names what it documents.

The names are compared with their definitions, so a new subcommand, option or setting without
documentation fails here: gpuhook(1) against the argparse parser (``gpuhook.cli._parser``, walked
through its subparsers), gpuhook.yaml(5) against ``dataclasses.fields(Config)`` and the ``gpus:``
keys, gpuhookd(8) against ``gpuhook daemon``'s options. Structure is read from the roff source
(``.SH``/``.SS`` headings, ``.TP`` terms), so line breaks of the rendering never matter.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from gpuhook.cli import _parser
from gpuhook.config import Config
from gpuhook.request import parse, quick
from gpuhook.request.grammar import Keyword
from gpuhook.request.model import Capability
from gpuhook.sharing.policy import FILE_KEYS, YAML_KEYS, Sharing

MAN = Path(__file__).resolve().parents[2] / "packaging" / "man"
PAGES = ("gpuhook.1", "gpuhook.yaml.5", "gpuhookd.8", "gpuhook-runtime.1", "nvidia-ctk.1")
_ESCAPES = re.compile(r"\\f(?:\[[^]]*\]|\(..|.)|\\&|\\\||\\\^|\\:|\\c")


def plain(roff: str) -> str:
    """roff text without font escapes, with its escaped characters as typed."""
    text = _ESCAPES.sub("", roff)
    return text.replace("\\-", "-").replace("\\(aq", "'").replace("\\(dq", '"').replace("\\e", "\\").replace(
        "\\(em", "-").replace("\\ ", " ").replace("\\~", " ")


def _title(args: str) -> str:
    return plain(args.strip().strip('"'))


def sections(page: str) -> dict[str, dict[str, str]]:
    """``{SECTION: {SUBSECTION or "": body}}`` of a page's source (bodies still roff, one line each)."""
    out: dict[str, dict[str, str]] = {}
    section, sub = "", ""
    for line in (MAN / page).read_text(encoding="utf-8").splitlines():
        if line.startswith(".SH"):
            section, sub = _title(line[3:]), ""
            out.setdefault(section, {})
        elif line.startswith(".SS"):
            sub = _title(line[3:])
            out.setdefault(section, {}).setdefault(sub, "")
        else:
            block = out.setdefault(section, {})
            block[sub] = block.get(sub, "") + line + "\n"
    return out


def terms(body: str) -> list[str]:
    """The first word of each ``.TP`` item's term line (a setting's, a key's or an option's name)."""
    lines = body.splitlines()
    found = []
    for n, line in enumerate(lines[:-1]):
        if line.strip() == ".TP":
            term = re.sub(r"^\.[A-Z]{1,2}\s+", "", lines[n + 1])  # the font macro (.B, .BR, ...) of the term
            words = plain(term).replace('"', " ").replace(",", " ").split()
            if words:
                found.append(words[0].rstrip(":"))
    return found


def names(text: str, word: str) -> bool:
    """Whether *text* (plain) names *word* as a whole token (``--config`` is not in ``--config-file``)."""
    return re.search(rf"(?<![\w-]){re.escape(word)}(?![\w-])", text) is not None


def _subparsers(parser: argparse.ArgumentParser) -> list[argparse._SubParsersAction]:  # type: ignore[type-arg]
    return [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]


def commands(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> dict[str, argparse.ArgumentParser]:
    """Every documented (helped) command path of *parser*, nested ones included: ``{"cdi generate": parser}``.

    A subparser added without ``help=`` (``cdi-hook``: only the generated CDI spec calls it) is hidden
    from ``--help`` and from the page alike."""
    found: dict[str, argparse.ArgumentParser] = {}
    for action in _subparsers(parser):
        helped = {choice.dest for choice in action._choices_actions}
        for name, sub in action.choices.items():
            if name not in helped:
                continue
            path = (*prefix, name)
            found[" ".join(path)] = sub
            found.update(commands(sub, path))
    return found


def options(parser: argparse.ArgumentParser) -> list[str]:
    """A parser's own option strings, positional metavars and string choices (not --help, not subparsers)."""
    words: list[str] = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
            continue
        if action.option_strings:
            words += [s for s in action.option_strings if s.startswith("--")] or action.option_strings
        else:
            words.append(str(action.metavar or action.dest))
        words += [c for c in action.choices or () if isinstance(c, str)]
    return words


def test_command_walk_finds_nested_and_hides_unhelped() -> None:
    """The walk itself: nested commands are found, the hidden cdi-hook is not (the checks below rest on it)."""
    found = commands(_parser())
    assert {"cdi", "cdi generate", "cdi list", "daemon", "install", "prestart"} <= set(found)
    assert not any(path.startswith("cdi-hook") for path in found)
    assert {"--output", "--format", "yaml", "json"} <= set(options(found["cdi generate"]))


@pytest.mark.parametrize("page", PAGES)
def test_renders_without_warnings(page: str) -> None:
    """``man -l`` (groff with every warning on) formats the page and says nothing on stderr."""
    man = shutil.which("man")
    assert man, "man is missing: apt-get install man-db groff-base (make deps installs them)"
    env = {**os.environ, "MANWIDTH": "80", "LC_ALL": "C.UTF-8", "MANROFFSEQ": ""}
    proc = subprocess.run([man, "--warnings=w", "-E", "UTF-8", "-l", str(MAN / page)], capture_output=True,
                          text=True, env=env, check=False, timeout=60)
    assert (proc.returncode, proc.stderr) == (0, ""), f"{page}: man -l said:\n{proc.stderr}"
    assert "NAME" in proc.stdout and len(proc.stdout.splitlines()) > 20


@pytest.mark.parametrize("page", PAGES)
def test_page_has_the_usual_sections(page: str) -> None:
    """NAME (whatis reads its ``name \\- summary`` line), SYNOPSIS, DESCRIPTION, FILES and SEE ALSO."""
    found = sections(page)
    assert {"NAME", "SYNOPSIS", "DESCRIPTION", "FILES", "SEE ALSO"} <= set(found), sorted(found)
    name = page.rsplit(".", 1)[0]
    assert re.fullmatch(rf"{re.escape(name)} \\- \S.*\n", found["NAME"][""]), found["NAME"]
    section = page.rsplit(".", 1)[1]
    th = next(line for line in (MAN / page).read_text().splitlines() if line.startswith(".TH"))
    assert th.split()[1:3] == [name.upper(), section], th


def test_gpuhook_names_every_command_and_its_options() -> None:
    """gpuhook(1)'s COMMANDS has a subsection per command path, naming each of its options and choices."""
    documented = sections("gpuhook.1")["COMMANDS"]
    paths = {path: title for title in documented if title for path in title.split(", ")}
    parser_commands = commands(_parser())
    missing = sorted(set(parser_commands) - set(paths))
    assert not missing, f"gpuhook.1 COMMANDS has no subsection for: {missing}"
    stale = sorted(set(paths) - set(parser_commands))
    assert not stale, f"gpuhook.1 documents commands the parser does not have: {stale}"
    for path, sub in parser_commands.items():
        body = plain(documented[paths[path]])
        absent = [word for word in options(sub) if not names(body, word)]
        assert not absent, f"gpuhook.1, command {path!r}: not named: {absent}"


def test_gpuhook_names_the_global_options() -> None:
    """OPTIONS names every option of ``gpuhook`` itself (before the command)."""
    body = plain("".join(sections("gpuhook.1")["OPTIONS"].values()))
    absent = [word for word in options(_parser()) if word != "COMMAND" and not names(body, word)]
    assert not absent, f"gpuhook.1 OPTIONS: not named: {absent}"


def test_gpuhook_names_the_variables_and_tokens() -> None:
    """ENVIRONMENT names every NVIDIA_* variable the request parser reads and every capability; the
    device-list tokens (keywords, count=, mig=, indices, UUIDs, MIG by index and UUID) are described."""
    env = plain("".join(sections("gpuhook.1")["ENVIRONMENT"].values()))
    variables = [quick.VISIBLE_DEVICES, parse.DRIVER_CAPABILITIES, parse.DISABLE_REQUIRE, parse.REQUIRE_PREFIX + "CUDA",
                 parse.IMEX_CHANNELS, parse.MIG_CONFIG, parse.MIG_MONITOR, "CUDA_VERSION", "GPUHOOK_CONFIG",
                 *(f"NVIDIA_{name.upper()}" for name in parse.GATED)]
    absent = [v for v in variables if not names(env, v)]
    assert not absent, f"gpuhook.1 ENVIRONMENT: not named: {absent}"
    assert names(env, parse.REQUIRE_PREFIX + "*"), "NVIDIA_REQUIRE_* (every such variable) is not described"
    absent = [c.value for c in Capability if not names(env, c.value)]
    assert not absent, f"gpuhook.1 ENVIRONMENT: capabilities not named: {absent}"
    tokens = plain(sections("gpuhook.1")["ENVIRONMENT"]["Device list"])
    wanted = [k.value for k in Keyword] + ["count=N", "mig=PROFILE", "#NAME", "GPU-", "MIG-", "0:1", "0,1"]
    absent = [t for t in wanted if t not in tokens]
    assert not absent, f"gpuhook.1, Device list: tokens not described: {absent}"


def test_gpuhook_exit_codes_and_examples() -> None:
    """EXIT STATUS gives 0, 1 and 2; EXAMPLES quote docker --gpus as its CSV needs and show runc, podman, ctr."""
    found = sections("gpuhook.1")
    status = terms(found["EXIT STATUS"][""])
    assert status == ["0", "1", "2"], status
    examples = plain("".join(found["EXAMPLES"].values()))
    for wanted in ("--gpus all", "--gpus '\"device=0,1\"'", "--gpus 'all,\"capabilities=compute,utility\"'",
                   "runc run", "podman run", "ctr run", "--runtime nvidia", "nvidia-smi"):
        assert wanted in examples, f"gpuhook.1 EXAMPLES: no {wanted!r}"


def test_gpuhook_yaml_documents_every_setting() -> None:
    """gpuhook.yaml(5)'s SETTINGS has one item per Config field, no more, each with its type and default."""
    body = sections("gpuhook.yaml.5")["SETTINGS"]
    items = [t for text in body.values() for t in terms(text)]
    fields = [f.name for f in dataclasses.fields(Config)]
    assert sorted(set(fields) - set(items)) == [], "gpuhook.yaml.5 SETTINGS: undocumented settings"
    assert sorted(set(items) - set(fields)) == [], "gpuhook.yaml.5 SETTINGS: settings Config does not have"
    assert len(items) == len(set(items)), "a setting documented twice"
    for text in body.values():
        lines = text.splitlines()
        for n, line in enumerate(lines[:-1]):
            if line.strip() == ".TP":
                term = plain(lines[n + 1])
                assert "default" in term, f"gpuhook.yaml.5: {term!r} gives no default"


def test_gpuhook_yaml_documents_the_gpus_list_and_nvidia_fallback() -> None:
    """The ``gpus:`` entry's keys (and the device file's spellings), the sharing modes, and config.toml."""
    found = sections("gpuhook.yaml.5")
    gpus = found["THE GPUS LIST"]
    items = {t for text in gpus.values() for t in terms(text)}
    yaml_keys = set(dataclasses.astuple(YAML_KEYS))
    assert yaml_keys - items == set(), f"gpus: keys not documented as items: {sorted(yaml_keys - items)}"
    text = plain("".join(gpus.values()))
    absent = [k for k in dataclasses.astuple(FILE_KEYS) if not names(text, k)]
    assert not absent, f"device_policy file keys not named: {absent}"
    absent = [s.value for s in Sharing if not names(text, s.value)]
    assert not absent, f"sharing modes not named: {absent}"
    nvidia = plain("".join(found["NVIDIA'S CONFIG.TOML"].values()))
    for key in ("/etc/nvidia-container-runtime/config.toml", "accept-nvidia-visible-devices-envvar-when-unprivileged",
                "accept-nvidia-visible-devices-as-volume-mounts", "disable-require", "supported-driver-capabilities",
                "load-kmods", "no-cgroups", "root", "ldconfig", "gpuhook config import"):
        assert key in nvidia, f"gpuhook.yaml.5 NVIDIA'S CONFIG.TOML: no {key!r}"


def test_gpuhookd_names_the_daemon_options() -> None:
    """gpuhookd(8)'s OPTIONS names every option of ``gpuhook daemon`` and the global ones it honours."""
    body = plain("".join(sections("gpuhookd.8")["OPTIONS"].values()))
    daemon = commands(_parser())["daemon"]
    absent = [w for w in [*options(daemon), "--config", "--debug"] if not names(body, w)]
    assert not absent, f"gpuhookd.8 OPTIONS: not named: {absent}"
    text = plain((MAN / "gpuhookd.8").read_text())
    for wanted in ("gpuhookd.socket", "gpuhookd.service", "/run/gpuhook/gpuhookd.sock", "metrics_listen", "SIGTERM",
                   "--request-timeout"):
        assert wanted in text, f"gpuhookd.8: no {wanted!r}"


def test_runtime_page_is_its_own() -> None:
    """gpuhook-runtime(1) says what the wrapper does, not runc's help: create/run edit, the rest pass through."""
    text = plain((MAN / "gpuhook-runtime.1").read_text())
    for wanted in ("create", "run", "--log", "--log-format", "GPUHOOK_CONFIG", "nvidia-container-runtime",
                   "daemon.json", "containerd", "CRI-O", "runc", "BinaryName"):
        assert names(text, wanted), f"gpuhook-runtime.1: no {wanted!r}"


def test_nvidia_ctk_page_names_its_commands() -> None:
    """nvidia-ctk(1) names every command and option of gpuhook's nvidia-ctk parser, and the flags the issue pins."""
    from gpuhook.cli import nvctk

    found = sections("nvidia-ctk.1")
    documented = found["COMMANDS"]
    parser_commands = commands(nvctk._parser())
    assert sorted(set(parser_commands) ^ set(documented) - {""}) == [], "nvidia-ctk.1 COMMANDS differ from the parser"
    for path, sub in parser_commands.items():
        absent = [w for w in options(sub) if not names(plain(documented[path]), w)]
        assert not absent, f"nvidia-ctk.1, command {path!r}: not named: {absent}"
    body = plain("".join(found["OPTIONS"].values()))
    absent = [w for w in options(nvctk._parser()) if not names(body, w)]
    assert not absent, f"nvidia-ctk.1 OPTIONS: not named: {absent}"
    for path, flags in {"runtime configure": ("--runtime", "--set-as-default", "--config", "--dry-run", "docker",
                                              "containerd", "crio"),
                        "cdi generate": ("--output", "--format", "yaml", "json"), "cdi list": (), "config": ()}.items():
        absent = [f for f in flags if not names(plain(documented[path]), f)]
        assert not absent, f"nvidia-ctk.1 {path}: not named: {absent}"
