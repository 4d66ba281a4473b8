"""``python -m leantrain`` is the ``leantrain`` command."""

import sys

from .cli.main import main

sys.exit(main())
