from __future__ import annotations

import sys

from pockengine.cli import main

sys.exit(main())
