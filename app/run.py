"""Entry point: ``python app/run.py [--tune] [--resume] ...`` (also installed as ``lightray``)."""

import os
import sys

if __package__ in (None, ""):
    # `python app/run.py` puts app/ first on sys.path; lightray's modules are imported as `app.x`.
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from app.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(guard=True))
