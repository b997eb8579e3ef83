"""The console's vendored htmx is the file its README names (version, digest, license), and the
package ships it with its templates: no page depends on another site or a build step."""

from __future__ import annotations

import hashlib
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STATIC = ROOT / "orchestrator" / "console" / "static"


def test_the_vendored_htmx_is_the_one_its_readme_names() -> None:
    readme = (STATIC / "README.md").read_text()
    digest = re.search(r"SHA-256 of `htmx.min.js`: `([0-9a-f]{64})`", readme)
    assert digest, "the README names the digest of htmx.min.js"
    data = (STATIC / "htmx.min.js").read_bytes()
    assert hashlib.sha256(data).hexdigest() == digest.group(1)
    version = re.search(r"\| (\d+\.\d+\.\d+) \| Zero-Clause BSD", readme)
    assert version and f'version:"{version.group(1)}"' in data.decode()
    assert "Zero-Clause BSD" in (STATIC / "htmx.LICENSE").read_text()


def test_the_package_ships_the_templates_and_static_files() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    setuptools = config["tool"]["setuptools"]
    assert "orchestrator.console" in setuptools["packages"]
    assert set(setuptools["package-data"]["orchestrator.console"]) == {
        "templates/*.html", "static/*"}
    extras = config["project"]["optional-dependencies"]
    assert "orchestrator[console]" in extras["dev"]  # `make install` installs the console
