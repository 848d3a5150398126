"""The architecture's import rules, checked on the source (DESIGN.md "Import direction")."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[2] / "gpuhook"
PURE = ("oci", "request", "planning", "catalog.py", "inventory.py")
FORBIDDEN_IN_PURE = ("pynvml", "psutil", "ctypes", "yaml", "structlog", "gpuhook.discovery", "gpuhook.apply",
                     "gpuhook.linux", "gpuhook.cli", "subprocess", "os")


def _imports(path: Path) -> set[str]:
    """Every module a file imports (absolute names)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def _files(*parts: str) -> list[Path]:
    """Python files of the named subpackages/modules."""
    out = []
    for part in parts:
        path = PACKAGE / part
        out += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return out


@pytest.mark.parametrize("path", _files(*PURE), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_pure_core_does_no_io(path: Path) -> None:
    """oci/request/planning/catalog/inventory import nothing that touches the host."""
    bad = {name for name in _imports(path) for f in FORBIDDEN_IN_PURE if name == f or name.startswith(f + ".")}
    assert not bad, f"{path.name} imports {sorted(bad)}"


def test_only_nvml_module_imports_pynvml() -> None:
    """pynvml lives in discovery/nvml.py alone; apply never imports discovery."""
    for path in _files("."):
        if "pynvml" in _imports(path):
            assert path == PACKAGE / "discovery" / "nvml.py"
    for path in _files("apply"):
        assert not any(n.startswith("gpuhook.discovery") for n in _imports(path)), path


def test_no_gpu_path_imports_stay_light() -> None:
    """Importing the hook's entry modules loads no YAML, structlog, pynvml or psutil."""
    code = ("import sys, gpuhook.cli, gpuhook.cli.hook; "
            "print(sorted(m for m in ('yaml','structlog','pynvml','psutil') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
