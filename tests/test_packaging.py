"""What a wheel ships: every package folder is listed in pyproject.toml, and package data
(shipped configs, hardware and cluster TOMLs, the HTML report's assets) is declared and
read through importlib.resources. `.ci/run` builds the wheel, installs it in a second venv
and imports every module from outside the checkout; these tests keep the declaration honest
so that run cannot be the first to find a folder left out."""

from __future__ import annotations

import fnmatch
import sys
from importlib import resources
from pathlib import Path

import pytest

import torchroof

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(torchroof.__file__).resolve().parent.parent
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _package_folders() -> dict[str, Path]:
    """Every folder holding an ``__init__.py`` under each mapped root, by package name."""
    found: dict[str, Path] = {}
    for package, folder in SETUPTOOLS["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            if "__pycache__" not in rel:
                found[".".join([package, *rel])] = init.parent
    return found


def test_every_package_folder_is_listed() -> None:
    # a folder with an __init__.py left out of `packages` is left out of the wheel: the
    # installed `import torchroof` then fails on its first import of it
    assert sorted(_package_folders()) == sorted(SETUPTOOLS["packages"])


def test_every_data_file_is_declared() -> None:
    # every non-Python file inside a package folder matches a package-data pattern
    # of the innermost package that holds it (torchroof/render/assets/ is torchroof.render's)
    declared = SETUPTOOLS["package-data"]
    folders = _package_folders()
    for package, folder in folders.items():
        patterns = declared.get(package, [])
        inner = [f for f in folders.values() if f != folder and folder in f.parents]
        for path in folder.rglob("*"):
            rel = path.relative_to(folder)
            if path.is_dir() or path.suffix in (".py", ".pyc") or "__pycache__" in rel.parts:
                continue
            if any(f in path.parents for f in inner):
                continue  # a file of a package inside this one
            assert any(fnmatch.fnmatch(rel.as_posix(), p) for p in patterns), (package, rel)


@pytest.mark.parametrize(
    ("package", "folder", "suffix", "at_least"),
    [
        ("torchroof.models", "configs", ".json", 11),  # the eleven shipped model configs
        ("torchroof.hardware", ".", ".toml", 10),  # the ten shipped accelerators
        ("torchroof.hardware", "clusters", ".toml", 7),  # the seven shipped clusters
        ("torchroof.render", "assets", ".js", 1),  # the report's script
    ],
)
def test_package_data_reads_through_importlib_resources(
    package: str, folder: str, suffix: str, at_least: int
) -> None:
    entries = [e for e in (resources.files(package) / folder).iterdir() if e.name.endswith(suffix)]
    assert len(entries) >= at_least
    assert all(e.read_bytes() for e in entries)  # none empty


def test_shipped_lists_come_from_package_data() -> None:
    from torchroof.hardware import available, available_clusters

    from torchroof.models.sources import shipped_models

    assert "llama-3-8b" in shipped_models()
    assert "h100-sxm" in {spec.name for spec in available()}
    assert "dgx-h100" in {c.name for c in available_clusters()}
