"""``python -m fusionguard COMMAND ...``: the ``fusionguard`` command line (``cli.py``: ``report``,
``run``, ``doctor``), for an environment without the console script on ``PATH``."""

import sys

from fusionguard.cli import main

sys.exit(main())
