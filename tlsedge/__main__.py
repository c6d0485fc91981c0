"""``python -m tlsedge`` is the ``tlsedge`` command."""

from __future__ import annotations

import sys

from tlsedge._control.cli import main

sys.exit(main())
