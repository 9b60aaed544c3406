"""`python -m agent` runs the agent CLI."""

from __future__ import annotations

import sys

from agent.cli import main

sys.exit(main())
