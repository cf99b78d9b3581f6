"""What the command line's tests share."""

from __future__ import annotations

import re


def one_error_line(err: str, exit_code: int, rc: int) -> str:
    assert rc == exit_code, err
    assert "Traceback" not in err
    # the stages said before it (remat.planner.progress: "remat plan: profiling ...") aside,
    # one line: the error, last
    lines = [line for line in err.strip().splitlines() if not _STAGE.match(line)]
    assert len(lines) == 1, err
    return lines[0]


_STAGE = re.compile(r"remat \w+: (profiling|measuring|planning|planned) ")


def interrupted(*args, **kwargs):
    raise KeyboardInterrupt
