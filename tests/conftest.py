from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

os.environ.setdefault("PE_DEBUG", "1")  # verify after every pass in tests
# Compile in this process unless a test asks for a child: a forked child starts torch.export
# cold every time (about a second), which hundreds of compiles in one process would pay;
# tests/test_compile_child_fork.py covers the child path, the default included.
os.environ.setdefault("PE_COMPILE_IN", "process")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


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
