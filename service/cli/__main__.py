"""``python -m service.cli``: the same as the ``gqa-serve`` command."""

import sys

from .main import main

sys.exit(main())
