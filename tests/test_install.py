"""The install's pins (constraints.txt, written by scripts/freeze_constraints.sh): every
dependency pinned within pyproject.toml's ranges, torch left to the install, and the environment
the tests run in installed at them (a transformers release changed the trained embedded model
between two fresh clones)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

tomllib = pytest.importorskip("tomllib")  # Python 3.11+; the pins were checked on 3.11
ROOT = Path(__file__).resolve().parents[1]
# the libraries the default run's figures are computed with (training, capture, statistics)
RESULT_LIBRARIES = ("transformers", "tokenizers", "safetensors", "accelerate", "numpy", "scipy",
                    "polars", "duckdb", "pyarrow")  # fmt: skip


def read_pins(path: Path) -> dict[str, str]:
    """constraints.txt -> {canonical name: version}; anything but `name==version` is an error."""
    pins: dict[str, str] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        name, sep, ver = line.partition("==")
        if not sep or not ver or any(c in ver for c in " ;<>,"):
            raise ValueError(f"{path.name}:{n}: expected name==version, got {line!r}")
        pins[canonicalize_name(name)] = ver
    return pins


def requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    reqs = project["build-system"]["requires"] + project["project"]["dependencies"]
    reqs += project["project"]["optional-dependencies"]["dev"]
    return [r for r in map(Requirement, reqs) if r.marker is None or r.marker.evaluate()]


def test_every_dependency_is_pinned_within_its_range():
    pins = read_pins(ROOT / "constraints.txt")
    assert "torch" not in pins  # install.sh chooses the build; a CUDA environment keeps its own
    assert "moesub" not in pins
    for req in requirements():
        name = canonicalize_name(req.name)
        if name == "torch":
            continue
        assert name in pins, f"{req.name}: not in constraints.txt (scripts/freeze_constraints.sh)"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"constraints.txt pins {req.name}=={pins[name]}, outside pyproject.toml's {req}"
        )


def test_the_pins_are_read_strictly(tmp_path):
    good = tmp_path / "good.txt"
    good.write_text("# a comment\n\nTransformers==5.24.0\nPyYAML==6.0.4\n")
    assert read_pins(good) == {"transformers": "5.24.0", "pyyaml": "6.0.4"}
    bad = tmp_path / "bad.txt"
    for line in ("numpy>=2", "numpy==2.4; python_version < '3.12'", "numpy=="):
        bad.write_text(line + "\n")
        with pytest.raises(ValueError, match="bad.txt:1: expected name==version"):
            read_pins(bad)


@pytest.mark.parametrize("name", RESULT_LIBRARIES)
def test_the_environment_has_the_pinned_versions(name):
    pinned = read_pins(ROOT / "constraints.txt")[name]
    try:
        have = version(name)
    except PackageNotFoundError:
        pytest.fail(f"{name} is not installed (make install)")
    assert have == pinned, (
        f"this environment has {name} {have}, constraints.txt pins {pinned}: reinstall (make "
        "install), or check the suite and the default run with it and refresh the pins "
        "(scripts/freeze_constraints.sh)"
    )
