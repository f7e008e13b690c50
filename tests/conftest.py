from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest

os.environ.setdefault("PE_DEBUG", "1")  # verify after every pass in tests
# Compile in this process unless a test asks for a child: a forked child starts torch.export
# cold every time (about a second), which hundreds of compiles in one process would pay;
# tests/test_compile_child_fork.py covers the child path, the default included.
os.environ.setdefault("PE_COMPILE_IN", "process")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


_CC_CACHE: list[str] = []  # the folder this process made for tests/cached_cc.py


def pytest_configure(config: pytest.Config) -> None:
    """One folder of kernel objects for the exported trainers' builds (tests/cached_cc.py),
    made by the process that starts the session; pytest-xdist's workers inherit it."""
    if "PE_TEST_CC_CACHE" not in os.environ:
        _CC_CACHE.append(tempfile.mkdtemp(prefix="pe-test-cc-"))
        os.environ["PE_TEST_CC_CACHE"] = _CC_CACHE[0]


def pytest_unconfigure(config: pytest.Config) -> None:
    for folder in _CC_CACHE:
        shutil.rmtree(folder, ignore_errors=True)
        os.environ.pop("PE_TEST_CC_CACHE", None)


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """One intra-op torch thread for the test (``pytestmark = pytest.mark.usefixtures(...)``):
    on a loaded machine OpenMP's spinning threads slow small kernels down tenfold. Results
    do not depend on it; the engine itself sets nothing."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", autouse=True)
def _curves_drawn_only_where_checked(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fine-tuning runs in this process draw no curves.png unless the module is marked
    ``curves``: each drawing is a child process (about 1.2 s of CPU to start Python,
    PockEngine and matplotlib) and a run waits for one drawing before the next, which is
    most of a small run's time. tests/test_run_output.py (marked) checks the drawing, and
    runs in other processes (the command line's, started by subprocess) still draw."""
    if request.node.get_closest_marker("curves") is not None:
        yield
        return
    from pockengine.finetune.running import curves

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(curves.CurvesWriter, "update", lambda self, info: None)
        yield
