"""``python -m spdkfac.simulate profile|predict ...`` (see :mod:`spdkfac.simulate.cli`)."""

import sys

from .cli import main

sys.exit(main())
