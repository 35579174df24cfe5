"""pytest configuration of the whole suite; shared helpers live in mext_testing.py.

Every test carries one marker of where it runs, from its folder: ``gpu`` (tests/gpu: needs
CUDA, skipped without it), ``slurm`` (tests/slurm: a real Slurm cluster on localhost),
``distributed`` (tests/distributed: several processes over gloo on the CPU), ``cpu`` (the
rest: unit, functional and tool tests on one CPU process). Select with ``-m``, e.g.
``python -m pytest -m "cpu or distributed"`` on a laptop or ``-m gpu`` on the GPU machine.
"""

import os
from pathlib import Path

import pytest

from mext_testing import RunCache

_TESTS = Path(__file__).resolve().parent
_FOLDER_MARKERS = {"gpu": "gpu", "slurm": "slurm", "distributed": "distributed"}


def pytest_collection_modifyitems(config, items):
    """Marks each test by the folder it lives in (see the module docstring)."""
    for item in items:
        try:
            top = Path(str(item.fspath)).resolve().relative_to(_TESTS).parts[0]
        except ValueError:
            continue
        item.add_marker(getattr(pytest.mark, _FOLDER_MARKERS.get(top, "cpu")))


@pytest.fixture(scope="session")
def run_cache(tmp_path_factory) -> RunCache:
    """The session's shared pretrain_gpt.py runs (``mext_testing.RunCache``).

    Under pytest-xdist every worker's temporary directory lies in the session's one, so the
    workers share the runs.
    """
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    return RunCache(base / "shared-runs")
