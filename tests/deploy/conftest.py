"""Tests of what ships under deploy/: the helpers of tests/support.py for the processes they start."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
