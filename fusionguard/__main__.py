"""``python -m fusionguard report PATH...``"""

import sys

from .cli import main

sys.exit(main())
