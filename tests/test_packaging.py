"""pyproject.toml lists every package explicitly (with package-dir), so `pip install -e .` installs a plain
.pth entry without setuptools' warning about "folders in your working directory with the same name as your
package" (issue 23), and no package is left out of a wheel."""
import os
import tomllib

from tests.conftest import REPO

SKIP = {"tests", "build", "output"}


def packages_on_disk():
    found = []
    for root, dirs, files in os.walk(REPO):
        rel = os.path.relpath(root, REPO)
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in SKIP and not d.endswith(".egg-info")
                   and d != "__pycache__"]
        if rel != "." and "__init__.py" in files:
            found.append(rel.replace(os.sep, "."))
    return sorted(found)


def test_every_package_is_listed_and_nothing_is_found_by_pattern():
    with open(REPO / "pyproject.toml", "rb") as f:
        setuptools = tomllib.load(f)["tool"]["setuptools"]
    assert "find" not in setuptools.get("packages", [])  # packages.find: the editable finder and its warning
    assert setuptools["package-dir"] == {"": "."}  # with an explicit list: a plain .pth (no finder, no warning)
    assert sorted(setuptools["packages"]) == packages_on_disk()
    assert all(os.path.isfile(REPO / f"{m}.py") for m in setuptools["py-modules"])
