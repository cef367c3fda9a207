"""``python -m jaxmp``: the same as the ``jaxmp`` command."""

import sys

from jaxmp.cli import main

sys.exit(main())
