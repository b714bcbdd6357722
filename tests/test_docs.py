"""The documentation: docs/ builds as a MkDocs site in strict mode (a broken link, an unknown anchor or a page
left out of the nav fails it), and the README stays a short entry point whose first screen has the setup."""

import pathlib
import shutil
import subprocess
import sys

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]
MKDOCS = pathlib.Path(sys.executable).with_name("mkdocs")


def _build(project: pathlib.Path, site: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(MKDOCS), "build", "--strict", "--site-dir", str(site)],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _nav_pages(nav) -> list[str]:
    pages = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages.extend(_nav_pages(value) if isinstance(value, list) else [value])
    return pages


def test_docs_build_strict(tmp_path):
    done = _build(ROOT, tmp_path / "site")
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "index.html").exists()


def test_a_broken_link_fails_the_strict_build(tmp_path):
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    with open(tmp_path / "docs" / "serving.md", "a") as page:
        page.write("\nSee [a page that does not exist](no-such-page.md).\n")
    done = _build(tmp_path, tmp_path / "site")
    assert done.returncode != 0, done.stdout + done.stderr
    assert "no-such-page.md" in done.stdout + done.stderr


def test_readme_is_short_with_the_setup_first_and_every_page_is_in_the_nav():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 300, len(lines)
    first_screen = "\n".join(lines[:30])
    assert "scripts/serve.sh" in first_screen and "scripts/test.sh" in first_screen
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert config["strict"] is True and config["docs_dir"] == "docs"
    pages = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    assert pages and set(_nav_pages(config["nav"])) == pages
