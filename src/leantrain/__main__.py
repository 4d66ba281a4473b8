"""``python -m leantrain`` is the ``leantrain`` command."""

import sys

from .cli import main

sys.exit(main())
