"""The README runs as written: every ```python block, top to bottom, in a fresh interpreter."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import textwrap

import remat

README = pathlib.Path(__file__).parent.parent / "README.md"
FENCE = re.compile(r"^```(\S*)[^\n]*\n(.*?)^```\s*$", re.MULTILINE | re.DOTALL)
LANGUAGES = {"python", "bash", "text"}


def fences() -> list[tuple[str, int, str]]:
    """``(language, first line number, code)`` of every fenced block, in order."""
    text = README.read_text()
    return [
        (m.group(1), text.count("\n", 0, m.start(2)) + 1, m.group(2)) for m in FENCE.finditer(text)
    ]


def test_readme_fences_are_python_bash_or_text():
    # a ```py or unlabelled block would escape the run below without saying so
    langs = [lang for lang, _, _ in fences()]
    assert langs and set(langs) <= LANGUAGES, langs


def test_readme_starts_with_the_two_setup_commands():
    lang, line, code = fences()[0]
    assert lang == "bash" and line < 10
    lines = code.strip().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("pip install torch==2.13.0 && ") and " remat bench " in lines[0]
    assert lines[1].startswith("pip install torch==2.13.0 && ") and "pytest" in lines[1]


def test_readme_first_python_example_is_short_and_early():
    lang, line, code = next(f for f in fences() if f[0] == "python")
    assert line <= 30 and len(code.strip().splitlines()) <= 10


def test_every_readme_python_block_runs_top_to_bottom_in_a_fresh_interpreter(tmp_path):
    blocks = [(line, code) for lang, line, code in fences() if lang == "python"]
    assert len(blocks) >= 4
    # each block is compiled under its README line numbers, so a failure points at the line
    script = textwrap.dedent(
        """
        import sys
        namespace = {"__name__": "__main__"}
        for line, code in BLOCKS:
            print(f"--- README.md line {line}", flush=True)
            exec(compile("\\n" * (line - 1) + code, "README.md", "exec"), namespace)
        import remat, pathlib
        print(f"remat from {pathlib.Path(remat.__file__).resolve()}")
        """
    ).replace("BLOCKS", repr(blocks))
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,  # whatever a block writes lands here
        env={**os.environ, "PYTHONPATH": _path_of_this_remat()},
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert done.stdout.count("--- README.md line") == len(blocks)
    assert f"remat from {pathlib.Path(remat.__file__).resolve()}" in done.stdout


def _path_of_this_remat() -> str:
    """PYTHONPATH under which the subprocess imports the remat these tests import."""
    src = str(pathlib.Path(remat.__file__).resolve().parent.parent)
    rest = os.environ.get("PYTHONPATH", "")
    return os.pathsep.join([src, *(p for p in rest.split(os.pathsep) if p)])
