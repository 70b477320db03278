"""The README's commands run as written, and every pointer to a README section lands.

- Each fenced block tagged `sh runnable` in README.md holds `kvpush` commands that need no
  server and no network and take seconds; each must exit 0. They run in that order in one
  empty folder (a later command may use what an earlier one built), against this
  checkout's kvpush.
- A reference to a README section from the code, tests or docs (`README#anchor`,
  `README, "Heading"`, `README "Heading"`) must name a heading that exists.
- Every relative link in README.md and docs/*.md must reach a file, and its heading.
- README.md and docs/ must point to nothing outside the repository.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
RUNNABLE = "sh runnable"
DOCS = [README, *sorted((REPO / "docs").glob("*.md"))]
# Where a README section may be referred to from.
SOURCES = ("kvpush", "tests", "scripts", "docs")
ANCHOR_REF = re.compile(r"README(?:\.md)?#([\w-]+)")
TITLE_REF = re.compile(r"README(?:\.md)?,?\s+(?:section\s+)?\"([^\"]{1,80})\"")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
OUTSIDE = ("../shared", "ENVIRONMENT.md")


def fenced_blocks(text: str) -> list[tuple[str, list[str]]]:
    """(info string, lines) of each fenced code block."""
    blocks: list[tuple[str, list[str]]] = []
    info: str | None = None
    lines: list[str] = []
    for line in text.splitlines():
        if info is None:
            if line.startswith("```"):
                info, lines = line[3:].strip(), []
        elif line.startswith("```"):
            blocks.append((info, lines))
            info = None
        else:
            lines.append(line)
    return blocks


def headings(text: str) -> list[str]:
    """The titles of the Markdown headings outside code blocks."""
    titles: list[str] = []
    fenced = False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (match := re.match(r"#{1,6}\s+(.+?)\s*$", line)):
            titles.append(match.group(1))
    return titles


def anchor(title: str) -> str:
    """The anchor GitHub gives a heading."""
    text = re.sub(r"[^\w\- ]", "", title.strip().lower())
    return text.replace(" ", "-")


def commands(text: str) -> list[list[str]]:
    """The commands of every runnable block, continuation lines joined, comments dropped."""
    found: list[list[str]] = []
    for info, lines in fenced_blocks(text):
        if info != RUNNABLE:
            continue
        joined = "\n".join(lines).replace("\\\n", " ")
        found += [argv for line in joined.splitlines() if (argv := shlex.split(line, True))]
    return found


def test_the_readme_has_runnable_kvpush_commands() -> None:
    found = commands(README.read_text())
    assert len(found) >= 5
    assert all(argv[0] == "kvpush" for argv in found), [a for a in found if a[0] != "kvpush"]


def test_runnable_readme_commands_exit_0(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    failed = []
    for argv in commands(README.read_text()):
        done = subprocess.run(
            [sys.executable, "-m", "kvpush.cli", *argv[1:]],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if done.returncode != 0:
            failed.append(f"{shlex.join(argv)} -> {done.returncode}: {done.stderr[-600:]}")
    assert not failed, "\n".join(failed)


def readme_references() -> list[tuple[str, str, str]]:
    """(file, kind, what) for every reference to a README section in the sources."""
    refs: list[tuple[str, str, str]] = []
    here = Path(__file__).resolve()
    for top in SOURCES:
        for path in sorted((REPO / top).rglob("*")):
            if path.suffix not in (".py", ".md", ".sh", ".toml") or path.resolve() == here:
                continue
            text = path.read_text(errors="replace")
            name = str(path.relative_to(REPO))
            refs += [(name, "anchor", a) for a in ANCHOR_REF.findall(text)]
            refs += [(name, "title", " ".join(t.split())) for t in TITLE_REF.findall(text)]
    return refs


def test_references_to_readme_sections_name_existing_headings() -> None:
    titles = headings(README.read_text())
    plain = {t.replace("`", "") for t in titles}
    anchors = {anchor(t) for t in titles}
    missing = [
        (name, what)
        for name, kind, what in readme_references()
        if (what not in anchors if kind == "anchor" else what.replace("`", "") not in plain)
    ]
    assert not missing, f"README has no such section: {missing}"


def lands(doc: Path, target: str) -> bool:
    """Whether a relative link in `doc` reaches a file in the repository (and its heading)."""
    path, _, fragment = target.partition("#")
    linked = (doc.parent / path).resolve() if path else doc
    if not linked.exists() or REPO not in linked.parents:
        return False
    return not fragment or fragment in {anchor(t) for t in headings(linked.read_text())}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_reach_a_file_and_heading(doc: Path) -> None:
    links = [t for t in LINK.findall(doc.read_text()) if not re.match(r"[a-z]+:", t)]
    broken = [target for target in links if not lands(doc, target)]
    assert not broken, f"{doc.name}: broken links {broken}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_docs_point_to_nothing_outside_the_repository(doc: Path) -> None:
    text = doc.read_text()
    assert not [s for s in OUTSIDE if s in text]


def test_no_file_points_outside_the_repository() -> None:
    """The project stands alone: code, scripts, test data and docs name nothing beside it."""
    this = Path(__file__).resolve()
    offenders = [
        str(path.relative_to(REPO))
        for top in (*SOURCES, "Makefile", ".ci")
        for path in ([REPO / top] if (REPO / top).is_file() else (REPO / top).rglob("*"))
        if path.is_file() and path.resolve() != this and "__pycache__" not in path.parts
        and any(s in path.read_text(errors="replace") for s in OUTSIDE)
    ]  # fmt: skip
    assert offenders == []


def test_anchor_is_githubs() -> None:
    assert anchor("Failures and security") == "failures-and-security"
    assert anchor("The proxy's overhead: `kvpush proxy bench`") == (
        "the-proxys-overhead-kvpush-proxy-bench"
    )
