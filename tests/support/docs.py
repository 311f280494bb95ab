"""The code blocks of the docs, to run them as written."""

from __future__ import annotations

import re
from pathlib import Path

from tests.support.processes import ROOT

_BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)


def python_blocks(doc: str) -> list[str]:
    """The ```python blocks of docs/<doc>, in order."""
    return _BLOCK.findall((ROOT / "docs" / doc).read_text())


def write_module(doc: str, index: int, folder: Path, name: str) -> Path:
    """Block `index` of docs/<doc> as the module `name` in `folder`."""
    path = folder / f"{name}.py"
    path.write_text(python_blocks(doc)[index])
    return path
