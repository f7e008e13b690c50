from __future__ import annotations

import os

os.environ.setdefault("PE_DEBUG", "1")  # verify after every pass in tests
# Compile in this process unless a test asks for a child: a forked child starts torch.export
# cold every time (about a second), which hundreds of compiles in one process would pay;
# tests/test_compile_child_fork.py covers the child path, the default included.
os.environ.setdefault("PE_COMPILE_IN", "process")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
