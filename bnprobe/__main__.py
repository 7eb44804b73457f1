"""``python -m bnprobe`` runs the command line."""

import sys

from bnprobe.cli import main

if __name__ == "__main__":  # not when a worker process started with spawn imports the main module again
    sys.exit(main())
