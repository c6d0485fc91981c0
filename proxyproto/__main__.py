"""``python -m proxyproto``: the same as the ``proxyproto`` command."""

from __future__ import annotations

import sys

from proxyproto._cli import main

if __name__ == "__main__":
    sys.exit(main())
