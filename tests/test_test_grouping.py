"""The suite's scheduling under ``make test`` (``-n 2 --dist loadgroup``): tests given one ``xdist_group``
run on one worker, when the groups are given as tests/conftest.py gives them (in a ``tryfirst`` collection
hook: pytest-xdist's own hook reads them into the node ids). Without ``tryfirst``, and with pytest 9.2
(pytest-xdist 3.8 writes node ids where pytest 9.2 no longer reads them) the grouping was silently lost:
every shared module fixture spread over both workers (CI showed seed 000's accuracy runs set
up twice), hence pyproject.toml's ``pytest<9.2``. This test fails if a pytest / pytest-xdist pair loses it."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("xdist")

CONFTEST = '''
import pytest

@pytest.hookimpl(tryfirst=True)  # as in tests/conftest.py
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.name.startswith("test_grouped"):
            item.add_marker(pytest.mark.xdist_group("together"))
'''
TESTS = "\n".join(f'''
def test_grouped_{i}(worker_id, tmp_path_factory):
    (tmp_path_factory.getbasetemp().parent / "grouped_{i}").write_text(worker_id)

def test_free_{i}():
    pass
''' for i in range(6))


def test_loadgroup_keeps_a_group_on_one_worker(tmp_path):
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_g.py").write_text(TESTS)
    base = tmp_path / "base"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
                           "--dist", "loadgroup", f"--basetemp={base}", "test_g.py"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    workers = {p.read_text() for p in Path(base).glob("grouped_*")}
    assert len(list(Path(base).glob("grouped_*"))) == 6
    assert len(workers) == 1, f"the group ran on {sorted(workers)}: pytest-xdist's loadgroup lost it"
