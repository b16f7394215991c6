"""The offline tools' packages are extras, not dependencies of the serving plugin, and a tool without its extra
refuses in one line that names the packages and the install command."""

from __future__ import annotations

import importlib.util
import sys
import tomllib
from pathlib import Path

import pytest

from pagedweight.tools.extras import DISTRIBUTION, EXTRAS, missing_modules

ROOT = Path(__file__).resolve().parent.parent


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _names(requirements: list[str]) -> set[str]:
    return {r.split("[")[0].split("=")[0].split(">")[0].split("<")[0].strip().lower() for r in requirements}


def test_pyproject_extras_hold_the_tools_packages_and_the_plugin_none():
    project = _pyproject()
    core = _names(project["dependencies"])
    extras = project["optional-dependencies"]
    for extra, modules in EXTRAS.items():
        assert set(modules) <= _names(extras[extra]), extra
        assert not core & _names(extras[extra]), f"{extra}'s packages are also core dependencies"
    assert project["name"] == DISTRIBUTION
    assert f"{DISTRIBUTION}[longbench,moefy]" in extras["test"]


def _hide(monkeypatch, module: str) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == module else real(name, *a))
    monkeypatch.setitem(sys.modules, module, None)  # `import module` raises ImportError too


def test_the_cli_builds_without_the_extras(monkeypatch, capsys):
    from pagedweight.cli import build_parser

    for module in ("gguf", "gensim", "scipy", "httpx", "rouge", "fuzzywuzzy", "jieba"):
        _hide(monkeypatch, module)
    for name in [m for m in sys.modules if m.startswith("pagedweight.moefy") or m.startswith("pagedweight.longbench")]:
        monkeypatch.delitem(sys.modules, name)  # re-imported with the packages hidden
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["--help"])
    assert exc.value.code == 0 and "moefy" in capsys.readouterr().out


def test_moefy_without_its_extra_refuses_in_one_line(monkeypatch, tmp_path):
    from pagedweight.cli import main

    _hide(monkeypatch, "gguf")
    assert missing_modules("moefy") == ["gguf"]
    with pytest.raises(SystemExit) as exc:
        main(["moefy", "--out", str(tmp_path / "m")])
    assert str(exc.value) == ("pagedweight moefy: needs the moefy extra (gguf not installed): "
                              f"pip install '{DISTRIBUTION}[moefy]'")
    assert not (tmp_path / "m").exists()  # nothing half-started


def test_longbench_without_its_extra_refuses_in_one_line(monkeypatch, tmp_path):
    from pagedweight.longbench.cli import main

    _hide(monkeypatch, "rouge")
    with pytest.raises(SystemExit) as exc:
        main(["make-fixtures", "--out", str(tmp_path / "f")])
    assert "pagedweight-longbench: needs the longbench extra (rouge not installed)" in str(exc.value)
    assert not (tmp_path / "f").exists()
