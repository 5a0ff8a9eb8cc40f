"""``python -m normwatch`` runs the command line."""

import sys

from normwatch.cli import main

sys.exit(main())
