"""``python -m jaxmp``: the same as the ``jaxmp`` command."""

import sys

from jaxmp._src.cli import main

if __name__ == "__main__":
  sys.exit(main())
