"""``python -m lazyckpt``: the same command line as the ``lazyckpt`` script."""

import sys

from lazyckpt.cli import main

if __name__ == "__main__":
    sys.exit(main())
