"""What the command line's tests share."""

from __future__ import annotations


def one_error_line(err: str, exit_code: int, rc: int) -> str:
    assert rc == exit_code, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def interrupted(*args, **kwargs):
    raise KeyboardInterrupt
