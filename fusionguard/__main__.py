"""``python -m fusionguard report PATH...``"""

import sys

from fusionguard.cli import main

sys.exit(main())
