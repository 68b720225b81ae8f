"""``python app/run.py ...`` from a checkout: the same as the installed ``lightray`` command (``lightray train``
when no subcommand is named, with the older ``--tune``, ``--report`` and ``--prepare-only`` flags kept)."""

import os
import sys

if __package__ in (None, ""):
    # `python app/run.py` puts app/ first on sys.path, where its modules would shadow top-level names (config,
    # data, ...); the checkout's root goes there instead, and the code is imported as the package lightray.
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

try:
    from lightray.cli import main
except ModuleNotFoundError as exc:
    if exc.name != "lightray":
        raise
    sys.exit(f"lightray: error: the package is not installed; run `pip install -e .` in "
             f"{os.path.dirname(os.path.dirname(os.path.abspath(__file__)))} first")

if __name__ == "__main__":
    sys.exit(main(guard=True))
