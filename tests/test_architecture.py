"""The documentation's map of the package stays true: every path and module it names exists,
and the tiers of docs/architecture.md hold (a module imports only from tiers below its own)."""

from __future__ import annotations

import ast
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import seqshard

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "src"
PACKAGE = SOURCE / "seqshard"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
DOCUMENTS = sorted((ROOT / "docs").glob("*.md")) + [
    ROOT / "DEVELOPERS.md",
    ROOT / "README.md",
    ROOT / "bench" / "README.md",
]
OUR_PATH = re.compile(r"(?<![\w/.])(?:seqshard|tests|bench|examples)/[\w/]*\w\.py\b")
# in the pages about the package itself, a backticked `formats/tar.py` is a path under seqshard/
PACKAGE_PAGES = (ARCHITECTURE, ROOT / "DEVELOPERS.md")
BACKTICKED_PATH = re.compile(r"`([\w/]+\.py)(?:::\w+)?`")
MODULE_NAME = re.compile(r"(?<![\w.])seqshard(?:\.\w+)+")
TIER_ROW = re.compile(r"^\| (\d+) \| (.+) \|$", re.MULTILINE)


def named_paths(document: Path) -> list[str]:
    text = document.read_text(encoding="utf-8")
    found = OUR_PATH.findall(text)
    if document in PACKAGE_PAGES:
        found += [p for p in BACKTICKED_PATH.findall(text) if not OUR_PATH.fullmatch(p)]
    return sorted(set(found))


def exists(path: str) -> bool:
    """A path from the repository root or from seqshard/; a bare file name (``tar.py`` in a
    row about ``formats/``) anywhere in the package."""
    if "/" not in path:
        return any(PACKAGE.rglob(path))
    return any((folder / path).is_file() for folder in (ROOT, SOURCE, PACKAGE))


@pytest.mark.parametrize("document", DOCUMENTS, ids=[d.name for d in DOCUMENTS])
def test_every_path_a_page_names_exists(document):
    missing = [path for path in named_paths(document) if not exists(path)]
    assert not missing, f"{document.name} names files that do not exist: {missing}"


def resolves(name: str) -> bool:
    """Whether ``seqshard.a.b.c`` is a module, or a name a module defines."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            if not hasattr(found, attribute):
                return False
            found = getattr(found, attribute)
        return True
    return False


@pytest.mark.parametrize("document", DOCUMENTS, ids=[d.name for d in DOCUMENTS])
def test_every_module_a_page_names_exists(document):
    names = set(MODULE_NAME.findall(document.read_text(encoding="utf-8")))
    assert not [n for n in sorted(names) if not resolves(n)], f"{document.name} names what does not exist"


def tiers() -> dict[str, int]:
    """Path under seqshard/ (a file, or a folder ending in /) -> its tier, from the table
    between the ``tiers`` markers of docs/architecture.md."""
    text = ARCHITECTURE.read_text(encoding="utf-8")
    table = text[text.index("<!-- tiers: begin -->") : text.index("<!-- tiers: end -->")]
    return {path: int(tier) for tier, paths in TIER_ROW.findall(table) for path in re.findall(r"`([^`]+)`", paths)}


def place_of(file: Path, table: dict[str, int]) -> str:
    """The longest path of the table that holds ``file``."""
    relative = file.relative_to(PACKAGE).as_posix()
    holding = [p for p in table if relative == p or (p.endswith("/") and relative.startswith(p))]
    assert holding, f"seqshard/{relative} is in no tier of docs/architecture.md"
    return max(holding, key=len)


def module_file(name: str) -> Path | None:
    path = SOURCE.joinpath(*name.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def package_of(file: Path) -> str:
    """The dotted package a file's relative imports start from."""
    name = ".".join(file.relative_to(SOURCE).with_suffix("").parts)
    return name[: -len(".__init__")] if file.name == "__init__.py" else name.rsplit(".", 1)[0]


def imports_of(source: str, package: str) -> set[Path]:
    """The seqshard files a module of ``package`` with this ``source`` imports, at its top or
    inside functions; a name taken from ``seqshard`` itself counts as its defining module
    (``__init__.py`` only hands names on)."""
    found: set[Path | None] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(module_file(a.name) for a in node.names if a.name.split(".")[0] == "seqshard")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.split(".")[0] != "seqshard":
                continue
            for alias in node.names:
                if module_file(f"{module}.{alias.name}") is not None:
                    found.add(module_file(f"{module}.{alias.name}"))
                elif module == "seqshard" and alias.name in seqshard.__all__:  # where the object is defined
                    found.add(module_file(getattr(getattr(seqshard, alias.name), "__module__", "seqshard")))
                else:
                    found.add(module_file(module))
    found.discard(None)
    return found  # type: ignore[return-value]


def upward_imports(table: dict[str, int], modules: dict[Path, str]) -> list[str]:
    """Imports of ``modules`` (file -> source) that do not go down a tier."""
    upward = []
    for file, source in modules.items():
        place = place_of(file, table)
        for target in sorted(imports_of(source, package_of(file))):
            there = place_of(target, table)
            if there != place and table[there] >= table[place]:
                upward.append(f"{file.relative_to(SOURCE)} (tier {table[place]}) imports "
                              f"{target.relative_to(SOURCE)} (tier {table[there]})")  # fmt: skip
    return upward


def test_every_import_goes_to_a_lower_tier():
    table = tiers()
    assert all(path.endswith("/") or (PACKAGE / path).is_file() for path in table), "a tier names no file"
    files = [f for f in sorted(PACKAGE.rglob("*.py")) if f.stat().st_size]  # empty __init__.py: no tier needed
    modules = {file: file.read_text(encoding="utf-8") for file in files}
    upward = upward_imports(table, modules)
    assert not upward, "imports that do not go down a tier:\n" + "\n".join(upward)


def test_a_climbing_import_is_caught():
    """The check itself: a module of formats/ importing the loader (directly, through the
    package's public names, or inside a function) is reported; one importing errors.py is not."""
    table = tiers()
    probe = PACKAGE / "formats" / "probe.py"
    source = (
        "from ..errors import ConfigError\n"
        "from seqshard import make_loader\n"
        "def later():\n    from ..pipeline.rank import shard_loader\n"
    )
    upward = upward_imports(table, {probe: source})
    assert upward == [
        "seqshard/formats/probe.py (tier 2) imports seqshard/loader.py (tier 10)",
        "seqshard/formats/probe.py (tier 2) imports seqshard/pipeline/rank/shard_loader.py (tier 9)",
    ]


ONCE_EXPORTED = [
    "Stage",
    "Sample",
    "Reader",
    "default_recipe",
    "keep_if",
    "stage_rng",
    "Seed",
    "split_batch",
    "plan_epoch",
    "ShardTable",
    "LoaderOptions",
    "OutputError",
    "Mux",
    "PlannedBatches",
    "PackReport",
    "UTTS_PER_FILE",
]


def test_a_small_surface_and_one_module_to_extend_from():
    """At most 25 public names; what a stage or a recipe is written with comes from
    seqshard.extend, whose docstring names each; a name once exported still resolves, with a
    DeprecationWarning naming its new import."""
    import seqshard.extend

    assert len(seqshard.__all__) <= 25
    assert all(f"`{name}`" in seqshard.extend.__doc__ for name in seqshard.extend.__all__)
    for name in ONCE_EXPORTED:
        with pytest.warns(
            DeprecationWarning, match=rf"seqshard\.{name} moved: use `from seqshard\.[\w.]+ import {name}`"
        ) as caught:
            moved = getattr(seqshard, name)
        module = re.search(r"from (\S+) import", str(caught[0].message)).group(1)
        assert getattr(importlib.import_module(module), name) is moved
    assert {"Stage", "keep_if", "default_recipe", "stage_rng"} <= set(seqshard.extend.__all__)


def test_python_started_beside_a_clone_folder_named_seqshard_imports_the_package(tmp_path):
    """The src layout: a folder named ``seqshard`` in the current folder (a clone's root, which
    holds no ``__init__.py``) is not imported as an empty namespace package in place of the
    installed one."""
    clone = tmp_path / "seqshard"
    (clone / "docs").mkdir(parents=True)
    (clone / "README.md").write_text("a clone's root\n")
    found = subprocess.run(
        [sys.executable, "-c", "import seqshard; print(seqshard.make_loader.__module__, seqshard.__file__)"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={key: value for key, value in os.environ.items() if key != "PYTHONPATH"},
    )
    assert found.returncode == 0, found.stderr
    module, where = found.stdout.split()
    assert module == "seqshard.loader" and Path(where).parent.name == "seqshard" and Path(where).parent != clone
