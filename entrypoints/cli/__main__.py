"""``python -m omni_runtime.entrypoints.cli``: the ``omni-runtime`` command."""

import sys

from . import main

sys.exit(main())
