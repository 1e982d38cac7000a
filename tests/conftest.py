"""Shared pytest fixtures."""
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("MEGATRON_SHARED_DATA", ROOT.parent / "shared" / "data"))

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@pytest.fixture
def shared_data():
    """Path to the read-only reference data; skips the test when it is absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"reference data not found at {SHARED_DATA}")
    return SHARED_DATA


def shared_file(*parts):
    """Path to one reference file, skipping the test when it is absent."""
    path = SHARED_DATA.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"reference file not found: {path}")
    return path
