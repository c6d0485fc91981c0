"""tests/tlsedge mirrors tlsedge's packages (README.md, Layout).

Each package of ``tlsedge/`` (a layer such as ``_core``, or ``_pipeline/http``)
has the test folder of the same path without the underscores
(``tests/tlsedge/core/``, ``tests/tlsedge/pipeline/http/``); the one other test
folder is ``e2e/``, for the edge as a whole. Every folder that holds tests is a
package, so that test files of one name in two folders are two modules.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "tlsedge"
TESTS = ROOT / "tests" / "tlsedge"


def packages_under(root: Path) -> set[Path]:
    """The folders under *root* (not *root* itself) with an ``__init__.py``."""
    return {p.parent.relative_to(root) for p in root.rglob("__init__.py")} - {Path()}


def test_every_package_has_its_test_folder_and_no_test_folder_is_stray() -> None:
    mirrored = {
        Path(*(part.removeprefix("_") for part in package.parts))
        for package in packages_under(PACKAGE)
    }
    assert Path("pipeline/http") in mirrored  # the walk reaches sub-packages
    assert packages_under(TESTS) == mirrored | {Path("e2e")}


def test_every_folder_with_tests_is_a_package() -> None:
    folders = {p.parent for p in TESTS.rglob("test_*.py")}
    assert {f for f in folders if not (f / "__init__.py").is_file()} == set()
