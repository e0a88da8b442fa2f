"""A non-editable install ships every package: the list in pyproject.toml names each directory
with an __init__.py under the three source trees (a missing one installs a broken wsched)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_is_listed():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = config["package-dir"]
    found = set()
    for prefix, top in (("wsched", "wsched"), ("wsched.lowering", "lowering"), ("wsched.codegen", "codegen")):
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / top)
            found.add(".".join((prefix, *rel.parts)))
    assert found - set(config["packages"]) == set()
    assert set(config["packages"]) - found == set()
    for package, path in dirs.items():
        assert (ROOT / path / "__init__.py").is_file(), package
