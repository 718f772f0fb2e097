"""``python -m kimi_encoder``: the ``kimi-encoder`` command, for when its entry point is
not on the PATH."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
