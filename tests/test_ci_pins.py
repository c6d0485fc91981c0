"""CI's toolchain is pinned: every package `.ci/run` installs has one exact
version in `.ci/constraints.txt`, inside the range pyproject.toml allows.

A test dependency added to the ``test`` extra without re-running
``bash .ci/lock`` fails here, before a release of it can turn CI red.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def pins() -> dict[str, Version]:
    """The constraints file as ``{canonical name: version}``."""
    out: dict[str, Version] = {}
    for line in (ROOT / ".ci" / "constraints.txt").read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        name, sep, version = line.partition("==")
        assert sep, f"not an exact pin: {line!r}"
        key = canonicalize_name(name)
        assert key not in out, f"{name} pinned twice"
        out[key] = Version(version)
    return out


def required() -> list[Requirement]:
    """What `.ci/run` asks pip for: the build backend, the runtime
    dependencies and the test extra."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    names = [
        *project["build-system"]["requires"],
        *project["project"]["dependencies"],
        *project["project"]["optional-dependencies"]["test"],
    ]
    return [Requirement(name) for name in names]


def test_every_requirement_is_pinned_inside_its_range() -> None:
    pinned = pins()
    for requirement in required():
        key = canonicalize_name(requirement.name)
        assert key in pinned, f"{requirement.name} is not in .ci/constraints.txt"
        assert requirement.specifier.contains(pinned[key], prereleases=True), (
            f"{requirement.name}=={pinned[key]} is outside {requirement.specifier}"
        )


def test_ci_installs_with_the_constraints() -> None:
    script = (ROOT / ".ci" / "run").read_text()
    installs = [line for line in script.splitlines() if "pip install" in line]
    assert installs
    for line in installs:
        assert '-c "$pins"' in line, line
