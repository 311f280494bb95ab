"""Every Python example of the README and of docs/*.md runs as written.

Each page is a session: its ```python blocks run in order, top to bottom, in
one fresh interpreter, as one module whose lines are the page's lines (a
traceback's `docs_flow.py, line 240` is docs/flow.md, line 240), with
`EVERYSTEP_DATABASE_URL` naming a migrated database of the test's own. A
page added later is covered as it is. Two marks, each an HTML comment on
the line right above the block (docs/design.md, "Examples in the docs"):

- `<!-- file: NAME -->`: the block is the file NAME of a complete example,
  written beside the module (its other blocks can import it); a `test_*.py`
  file is run with pytest;
- `<!-- example: fragment: REASON -->`: the block is not runnable alone (the
  reason says why); it is only compiled. Rare: at most one block in five.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.processes import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^(?:<!-- (?P<mark>[^\n]*?) -->\n)?```python\n(?P<code>.*?)^```", re.S | re.M)
FRAGMENT = "example: fragment:"


@dataclass
class Example:
    page: Path
    line: int  # the page's line of the block's first line of code
    code: str
    mark: str

    @property
    def file(self) -> str | None:
        return self.mark.removeprefix("file:").strip() if self.mark.startswith("file:") else None

    @property
    def fragment(self) -> bool:
        return self.mark.startswith(FRAGMENT)


def examples(page: Path) -> list[Example]:
    text = page.read_text()
    return [Example(page, text.count("\n", 0, m.start("code")) + 1, m["code"], (m["mark"] or "").strip())
            for m in BLOCK.finditer(text)]


def module_name(page: Path) -> str:
    return "docs_" + re.sub(r"\W", "_", page.stem.lower())


def session(page: Path) -> str:
    """The page's runnable blocks as one module, each at its own line."""
    lines: list[str] = []
    for example in examples(page):
        if example.file or example.fragment:
            continue
        lines += [""] * (example.line - 1 - len(lines))
        lines += example.code.splitlines()
    return "\n".join(lines) + "\n"


RUNNABLE = [page for page in PAGES if any(not e.fragment for e in examples(page))]


def test_the_marks_are_known_justified_and_rare():
    every = [e for page in PAGES for e in examples(page)]
    assert every, "no examples found"
    for e in every:
        where = f"{e.page.relative_to(ROOT)}:{e.line}"
        assert not e.mark or e.file or e.fragment, f"{where}: unknown mark <!-- {e.mark} -->"
        if e.fragment:
            assert e.mark.removeprefix(FRAGMENT).strip(), f"{where}: a fragment says why it cannot run"
        compile(e.code, where, "exec")  # a fragment too is Python
    fragments = [e for e in every if e.fragment]
    assert len(fragments) * 5 <= len(every), [f"{e.page.name}:{e.line}" for e in fragments]


@pytest.mark.parametrize("page", RUNNABLE, ids=[str(p.relative_to(ROOT)) for p in RUNNABLE])
def test_the_examples_of_the_page_run(page, db, tmp_path):
    for example in examples(page):
        if example.file:  # a path: myapp/flows.py is module myapp.flows
            (tmp_path / example.file).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / example.file).write_text(example.code)
    module = module_name(page)
    (tmp_path / f"{module}.py").write_text(session(page))
    env = {**os.environ, "EVERYSTEP_DATABASE_URL": db.url, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    ran = subprocess.run([sys.executable, "-c", f"import {module}"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=180)
    assert ran.returncode == 0, f"{page.relative_to(ROOT)}:\n{ran.stderr[-4000:]}"
    tests = sorted(name for name in (e.file for e in examples(page)) if name and name.startswith("test_"))
    if tests:
        ran = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", *tests],
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
        assert ran.returncode == 0, f"{page.relative_to(ROOT)}:\n{ran.stdout[-4000:]}"
