"""The docs stay a map of the code: the README's Layout names every code file, and every relative
link in the markdown files leads somewhere.

The Layout rule, chosen to be simple to follow and to check:

* the code files are the tracked ``.py``, ``.cpp`` and ``.h`` files under ``bloom_hpu/``,
  ``generation/``, ``bench/`` and ``utils/``, and ``bloom.py``; package markers (``__init__.py``)
  are left out, as they hold no code of their own worth a line;
* the Layout section is the README's text from ``## Layout`` to the next ``## `` heading, a table
  whose first cell names a folder (`` `generation/` ``, `` `generation/serving/` ``) or a file
  (`` `bloom.py` ``);
* each file belongs to the row of the nearest folder above it that has a row (its own folder's,
  else a parent's: ``csrc/`` files belong to ``bloom_hpu/runtime/cpu/``); it is named when its file
  name, in backticks (`` `engine.py` ``), appears in that row, or its whole path
  (`` `generation/serving/engine.py` ``) anywhere in the section. A name that several files of one
  row share must appear in it once per file;
* the other way round, every code file name in a folder's row must be a file somewhere under that
  folder (on disk, so that a file about to be committed may already be named).

Links: every ``[text](target)`` in a tracked markdown file whose target is not a URL must name a
tracked file or folder (relative to the markdown file), and an ``#anchor`` on a markdown target
must be the GitHub slug of one of its headings.
"""

from __future__ import annotations

import re
import subprocess
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CODE_PARTS = ("bloom_hpu", "generation", "bench", "utils")
CODE_SUFFIXES = (".py", ".cpp", ".h")


def tracked_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked files are unknown")
    return [line for line in out.stdout.splitlines() if (ROOT / line).exists()]


def code_files(tracked: list[str]) -> list[str]:
    files = []
    for path in tracked:
        parts = path.split("/")
        if path == "bloom.py" or (parts[0] in CODE_PARTS and path.endswith(CODE_SUFFIXES)):
            if parts[-1] != "__init__.py":
                files.append(path)
    return files


def layout_section(readme: str) -> str:
    match = re.search(r"^## Layout\n(.*?)(?=^## |\Z)", readme, flags=re.M | re.S)
    assert match, "README.md has no '## Layout' section"
    return match.group(1)


def layout_rows(section: str) -> dict[str, str]:
    """Folder or file ('generation', 'generation/serving', 'bloom.py') -> the text of its row."""
    rows = {}
    for line in section.splitlines():
        cell = re.match(r"\|\s*`([^`]+?)/?`\s*\|", line)
        if cell:
            rows[cell.group(1)] = line
    return rows


def unnamed_files(section: str, files: list[str]) -> list[str]:
    """The files of ``files`` that the Layout ``section`` does not name (the rule above)."""
    rows = layout_rows(section)

    def row_of(path: str) -> str | None:  # the nearest folder above the file that has a row
        keys = [key for key in rows if path.startswith(key + "/")]
        return max(keys, key=len) if keys else None

    shared = Counter((row_of(path), Path(path).name) for path in files)
    missing = []
    for path in files:
        if f"`{path}`" in section or path in rows:
            continue
        key, name = row_of(path), Path(path).name
        if key is not None and rows[key].count(f"`{name}`") >= shared[(key, name)]:
            continue
        missing.append(path)
    return missing


def test_layout_rule():
    section = ("| part | owns |\n| --- | --- |\n| `bloom.py` | the CLI |\n"
               "| `generation/` | `requests.py`, `jobs/`: `requests.py` |\n"
               "| `generation/serving/` | `engine.py` |\n")
    files = ["bloom.py", "generation/requests.py", "generation/jobs/requests.py",
             "generation/serving/engine.py", "generation/serving/app.py", "generation/serving/x/deep.py",
             "bench/run.py"]
    assert unnamed_files(section, files) == ["generation/serving/app.py", "generation/serving/x/deep.py",
                                             "bench/run.py"]
    assert unnamed_files(section.replace("`jobs/`: `requests.py`", "`jobs/`"), files[:3]) == [
        "generation/requests.py", "generation/jobs/requests.py"]


def test_layout_names_every_code_file():
    section = layout_section((ROOT / "README.md").read_text(encoding="utf-8"))
    files = code_files(tracked_files())
    assert files, "no code files found"
    missing = unnamed_files(section, files)
    assert not missing, (
        "README.md's Layout does not name these files (add the file name, in backticks, to its "
        f"folder's row, or its whole path): {missing}")


def test_layout_names_only_files_that_exist():
    """The other way round: every code file name the Layout gives (`` `name.py` ``, `` `name.h` ``)
    is a file of its part, so a file moved or removed does not live on in the README."""
    section = layout_section((ROOT / "README.md").read_text(encoding="utf-8"))
    stale = []
    for part, row in layout_rows(section).items():
        folder = ROOT / part
        if not folder.is_dir():
            continue
        present = {path.name for path in folder.rglob("*") if path.is_file()}
        for name in re.findall(r"`([\w.-]+\.(?:py|cpp|h))`", row):
            if name not in present:
                stale.append(f"{part}/…/{name}")
    assert not stale, f"README.md's Layout names files that do not exist: {stale}"


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())  # a link's text only
    text = text.lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    seen: Counter = Counter()
    found = set()
    fenced = False
    for line in markdown.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            continue
        heading = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if fenced or not heading:
            continue
        slug = github_slug(heading.group(1))
        found.add(slug if seen[slug] == 0 else f"{slug}-{seen[slug]}")
        seen[slug] += 1
    return found


def links(markdown: str) -> list[str]:
    """The targets of the inline links outside code (fenced blocks and `spans`)."""
    text = re.sub(r"^(```|~~~).*?^\1", "", markdown, flags=re.M | re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    return re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text)


def markdown_files(tracked: list[str]) -> list[str]:
    return [path for path in tracked if path.endswith(".md")]


def test_markdown_files_include_readme_and_docs():
    files = markdown_files(tracked_files())
    assert "README.md" in files
    assert any(path.startswith("docs/") for path in files)


def test_relative_links_lead_to_files_and_headings():
    tracked = tracked_files()
    existing = set(tracked) | {str(Path(p).parent) for p in tracked}
    broken = []
    for source in markdown_files(tracked):
        text = (ROOT / source).read_text(encoding="utf-8")
        for target in links(text):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            resolved = (ROOT / source).parent / path if path else ROOT / source
            try:
                relative = str(resolved.resolve().relative_to(ROOT))
            except ValueError:
                broken.append(f"{source}: {target} (outside the repository)")
                continue
            if relative.rstrip("/") not in existing and relative != ".":
                broken.append(f"{source}: {target} (no such file)")
                continue
            if anchor and relative.endswith(".md"):
                if anchor not in anchors((ROOT / relative).read_text(encoding="utf-8")):
                    broken.append(f"{source}: {target} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_slug_rule():
    assert github_slug("Weight-only int8 (`--quantize int8`)") == "weight-only-int8---quantize-int8"
    assert github_slug("Evaluating with lm-eval") == "evaluating-with-lm-eval"
    assert anchors("# A\n```\n# not a heading\n```\n## A\n") == {"a", "a-1"}
