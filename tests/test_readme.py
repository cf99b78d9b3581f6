"""The README runs as written: every ```python block, top to bottom, in a fresh interpreter,
and every sample output is what the code before it prints: a ```text block right after a
```python block is that block's output, a ```text block opening with ``$ remat ...`` is
that command's (``...`` lines stand for lines left out)."""

from __future__ import annotations

import contextlib
import io
import os
import pathlib
import re
import shlex
import subprocess
import sys
import textwrap

import pytest

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


@pytest.mark.slow  # 14 s: every block in a fresh interpreter
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
    printed = {
        int(m.group(1)): m.group(2).splitlines()
        for m in re.finditer(r"^--- README.md line (\d+)\n(.*?)(?=^--- README|^remat from)",
                             done.stdout, re.MULTILINE | re.DOTALL)
    }  # fmt: skip
    for line, sample in python_outputs().items():
        assert matches(sample, printed[line]), (line, printed[line])
    assert f"remat from {pathlib.Path(remat.__file__).resolve()}" in done.stdout


def _path_of_this_remat() -> str:
    """PYTHONPATH under which the subprocess imports the remat these tests import."""
    src = str(pathlib.Path(remat.__file__).resolve().parent.parent)
    rest = os.environ.get("PYTHONPATH", "")
    return os.pathsep.join([src, *(p for p in rest.split(os.pathsep) if p)])


# ---------------------------------------------------------------- set-up and claims


def test_readme_user_install_line_has_no_dev_extra_and_the_test_line_is_cis():
    lines = fences()[0][2].strip().splitlines()
    user, tests = (re.search(r"-e '\.\[([\w,]*)\]'", line) for line in lines)
    assert user is not None and "dev" not in user.group(1).split(",")  # no ruff, no mypy
    assert tests is not None and "test" in tests.group(1).split(",")  # pytest, hypothesis
    ci = (README.parent / ".ci" / "run").read_text()
    assert lines[1].split("&& ")[-1].split("#")[0].strip() == "python -m pytest -q -n 2"
    assert "python3 -m pytest -q -n 2\n" in ci  # CI runs the README's test command


def test_readme_states_the_supported_torch_range_of_pyproject():
    pyproject = (README.parent / "pyproject.toml").read_text()
    low = re.search(r'"torch>=([\d.]+)"', pyproject)
    assert low is not None
    assert f"remat needs torch {low.group(1)} or later" in README.read_text()


DURATION = re.compile(
    r"\b(about|in|took|takes)\s+(a minute|[\d.]+(-[\d.]+)?\s?(s|ms|us|seconds?|minutes?))\b"
)


def test_readme_timings_name_the_machine_they_were_measured_on():
    text = FENCE.sub("", README.read_text())
    paragraphs = [p for p in re.split(r"\n\s*\n", text) if DURATION.search(p)]
    assert paragraphs  # the check looks at something
    for p in paragraphs:
        assert "AMD EPYC" in p or "docs/BENCHMARKS.md" in p, p


# ---------------------------------------------------------------- sample outputs


def matches(sample: list[str], actual: list[str]) -> bool:
    """The sample's lines are the actual lines in order; a line ``...`` stands for any number
    of lines (the README leaves them out).

    Example:
        >>> matches(["a", "...", "d"], ["a", "b", "c", "d"]), matches(["a", "d"], ["a", "b", "d"])
        (True, False)
    """
    if not sample:
        return not actual
    if sample[0].strip() == "...":
        return any(matches(sample[1:], actual[k:]) for k in range(len(actual) + 1))
    return bool(actual) and sample[0].rstrip() == actual[0].rstrip() and matches(
        sample[1:], actual[1:]
    )


def shell_samples() -> list[tuple[int, list[str], list[str]]]:
    """``(line, argv, sample lines)`` of every ```text block that shows a ``$ remat ...`` run."""
    out = []
    for lang, line, code in fences():
        lines = code.rstrip("\n").splitlines()
        if lang == "text" and lines and lines[0].startswith("$ remat "):
            out.append((line, shlex.split(lines[0][2:])[1:], lines[1:]))
    return out


def python_outputs() -> dict[int, list[str]]:
    """``{line of a python block: its printed output}`` for each ```python block followed
    directly by a ```text block (nothing but a line break between): what the block prints."""
    text = README.read_text()
    found = list(FENCE.finditer(text))
    out = {}
    for a, b in zip(found, found[1:]):
        if a.group(1) == "python" and b.group(1) == "text" and not text[a.end() : b.start()].strip():
            out[text.count("\n", 0, a.start(2)) + 1] = b.group(2).rstrip("\n").splitlines()
    return out


def test_readme_shell_samples_are_what_the_commands_print(monkeypatch, tmp_path):
    from remat.cli import main

    monkeypatch.chdir(tmp_path)
    samples = [s for s in shell_samples() if s[1][0] != "bench"]  # bench: timed, slow below
    assert samples
    for line, argv, sample in samples:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
            assert main(argv) == 0, f"README.md:{line}"
        assert matches(sample, buf.getvalue().splitlines()), (line, buf.getvalue())


@pytest.mark.slow
def test_readme_bench_sample_is_what_remat_bench_prints_but_for_the_times(tmp_path):
    """A timed run (about 100 s): the bytes and the gradient differences are the sample's
    exactly (memory is deterministic) for the fixed strategies, the auto rows within their
    budgets; the times are this run's; the lines around the table have the sample's form."""
    (line, argv, sample) = next(s for s in shell_samples() if s[1][0] == "bench")
    done = subprocess.run(
        [sys.executable, "-m", "remat", *argv, "--no-save", "--no-progress"],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": _path_of_this_remat()},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    actual = done.stdout.splitlines()

    def memory_columns(rows: list[str]) -> dict[str, list[str]]:
        # strategy, peak step, mem x, activations, act x | step time, time x, spread, tie | dgrad
        out = {}
        for r in rows:
            cells = r.split()
            if len(cells) >= 12 and cells[2] == "MiB" and cells[5] == "MiB":
                out[cells[0]] = cells[:7] + cells[-1:]
        return out

    # an auto-N% plan is chosen by prices (the machine's calibration): among plans of nearly
    # equal cost another machine (or a fresh calibration) may pick another one, whose bytes
    # differ; the fixed strategies' bytes are the sample's on every machine
    want, got = memory_columns(sample), memory_columns(actual)
    assert want.keys() == got.keys()
    fixed = [k for k in want if not k.startswith("auto-")]
    assert {k: want[k] for k in fixed} == {k: got[k] for k in fixed}
    for k in set(want) - set(fixed):  # every auto row within its share of the activations
        share = int(k.removeprefix("auto-").removesuffix("%")) / 100
        assert float(got[k][6]) <= share + 0.01, (k, got[k])  # act x, to two places
    head = next(s for s in sample if s.startswith("strategy "))
    assert head in actual
    want = [s for s in sample if s.startswith("Recommendation")]
    assert want and want[0] in actual


def test_readme_python_outputs_are_what_the_blocks_print():
    assert python_outputs()  # the run below compares them; this says there are some
