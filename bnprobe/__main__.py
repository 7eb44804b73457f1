"""``python -m bnprobe`` runs the command line."""

import sys

from bnprobe.cli import main

sys.exit(main())
