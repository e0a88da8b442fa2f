"""`python -m wsched`: the command line (wsched/cli.py)."""

import sys

from .cli import main

sys.exit(main())
