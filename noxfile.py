"""The test suite under each torch of the tested range, each in its own environment.

    pip install nox                            # or: pip install -e '.[dev]'
    nox -l                             # the sessions: tests(2.11.0), tests(2.13.0), ...
    nox -s "tests(2.11.0)"             # the default suite (python -m pytest -q) on 2.11.0
    nox -s "tests(2.14.1)" -- -x tests/engine/test_checkpoint_curried.py   # pytest's arguments
    nox -s tests                       # every version, one after the other

Each session makes a fresh virtual environment, installs ``torch==<version>`` first
(pinned: nothing later may replace it), then remat with its test extras under a
constraint that holds torch at that version, prints the torch it got, and runs pytest.
``pip install torch==X`` takes the build the package index serves (on Linux from PyPI:
the CUDA build, several GB, which also runs on CPU); set ``REMAT_TORCH_INDEX`` to
``https://download.pytorch.org/whl/cpu`` for the CPU-only build.

CI (``.ci/run``) runs only the pinned 2.13.0 and does not use this file; the other
versions are run here, by hand, and recorded in the README's compatibility table.
"""

from __future__ import annotations

import os
import pathlib

import nox

#: The tested range's ends and CI's version (README, "Compatibility"); the oldest is
#: pyproject.toml's floor.
TORCH_VERSIONS = ["2.11.0", "2.13.0", "2.14.1"]
EXTRAS = "test,plot,plan,hf,lightning"


@nox.session(venv_backend="venv")
@nox.parametrize("torch", TORCH_VERSIONS, ids=TORCH_VERSIONS)
def tests(session: nox.Session, torch: str) -> None:
    """The default test suite (``python -m pytest -q``) under ``torch==<torch>``."""
    index = os.environ.get("REMAT_TORCH_INDEX")
    session.install(f"torch=={torch}", *(["--index-url", index] if index else []))
    constraints = pathlib.Path(session.create_tmp()) / "torch-constraint.txt"
    constraints.write_text(f"torch=={torch}\n")
    session.install("-c", str(constraints), "-e", f".[{EXTRAS}]")
    session.run("python", "-c", "import torch; print('torch', torch.__version__)")
    session.run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider", *session.posargs)
