"""``python -m baft.simulate``."""

import sys

from baft.simulate.model import main

sys.exit(main())
