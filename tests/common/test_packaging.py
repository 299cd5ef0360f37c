"""What the package installs: every product folder, and none of the tests (their helpers included)."""
from __future__ import annotations

import os
import re
import tomllib

import pagedserve

ROOT = os.path.dirname(os.path.abspath(pagedserve.__file__))       # the package: the repository root
NOT_PRODUCT = {"tests", "scripts", "docs", "benchmarks"}


def _product_files() -> list[str]:
    out = []
    for folder, subfolders, files in os.walk(ROOT):
        subfolders[:] = [d for d in subfolders if not d.startswith((".", "__")) and
                         not (folder == ROOT and d in NOT_PRODUCT)]
        out += [os.path.join(folder, f) for f in files if f.endswith(".py")]
    return out


def _package(folder: str) -> str:
    rel = os.path.relpath(folder, ROOT)
    return "pagedserve" if rel == "." else "pagedserve." + rel.replace(os.sep, ".")


def test_every_product_folder_is_packaged_and_no_test_is():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        listed = set(tomllib.load(f)["tool"]["setuptools"]["packages"])
    folders = {os.path.dirname(p) for p in _product_files() if p.endswith("__init__.py")}
    assert listed == {_package(d) for d in folders}
    assert not any(p.startswith("pagedserve.tests") for p in listed)


def test_no_product_module_imports_the_tests():
    """The test helpers are not installed: product code that imported them would break outside a checkout."""
    offenders = [os.path.relpath(p, ROOT) for p in _product_files()
                 if re.search(r"^\s*(from|import) pagedserve\.tests\b", open(p).read(), re.M)]
    assert offenders == []
