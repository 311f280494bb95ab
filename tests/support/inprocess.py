"""The `everystep` CLI run in this process (fast enough for a corpus of
cases): its exit status, stdout and stderr."""

from __future__ import annotations

import contextlib
import io

from everystep.cli import main


def run_cli(*argv: str) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `everystep ARGV...`; a usage error's SystemExit is its status."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as exit_:
            code = exit_.code
    return code, out.getvalue(), err.getvalue()
