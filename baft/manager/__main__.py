"""``python -m baft.manager``."""

import sys

from baft.manager.server import main

sys.exit(main())
