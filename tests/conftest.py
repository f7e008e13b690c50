from __future__ import annotations

import os

os.environ.setdefault("PE_DEBUG", "1")  # verify after every pass in tests
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
