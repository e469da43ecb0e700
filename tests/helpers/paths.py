"""Where the checkout and the tests' data are, wherever a test file sits."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DATA_DIR = REPO / "tests" / "data"
