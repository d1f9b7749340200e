"""The documentation site (mkdocs.yml, docs/): it builds in strict mode, so a broken link,
anchor or API reference fails the suite; every page is in the navigation; the README stays
the short page a newcomer reads first."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml
from docs_blocks_helpers import DOCS, REPO

README_LINES = 200


def _build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)


def test_the_site_builds_strict(tmp_path: Path) -> None:
    done = _build(REPO / "mkdocs.yml", tmp_path / "site")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    for name in ("colocar.connect", "colocar.colocated", "colocar.checkpoint.CheckpointManager"):
        assert f'id="{name}"' in api, f"the API reference lacks {name}"


def test_a_broken_link_fails_the_build(tmp_path: Path) -> None:
    """The check above can fail: the same validation settings, a link to an anchor that is not there."""
    ours = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\nSee [the part](other.md#no-such-part).\n")
    (docs / "other.md").write_text("# Other\n\n## A part\n")
    config = {
        "site_name": "check",
        "docs_dir": str(docs),
        "validation": ours["validation"],
        "nav": ["index.md", "other.md"],
    }
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    done = _build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert done.returncode != 0 and "no-such-part" in done.stdout + done.stderr


def test_every_page_is_in_the_navigation() -> None:
    pages = {f"docs/{p.name}" for p in (REPO / "docs").glob("*.md")}
    assert pages == {d for d in DOCS if d.startswith("docs/")}


def test_the_readme_is_short_and_points_into_the_docs() -> None:
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= README_LINES
    assert "make demo" in readme and "make test" in readme
    for page in ("getting-started", "calls", "pipelines", "checkpoints", "kubernetes", "slurm", "api"):
        assert f"(docs/{page}.md" in readme, page
