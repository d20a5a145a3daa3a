"""``python -m optimum_iobinding.bench``: the benchmark's command line (what ``optimum-iobinding bench`` runs)."""

import sys

from .cli import main

sys.exit(main())
