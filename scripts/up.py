"""`make up`: migrate, start web + worker + two local agents, register and place SmolLM2, print the URL.

The work is `manage.py swarm_up` (webapp/playground/management/commands), which starts, waits for and
stops its processes with `agent.procs`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

if __name__ == "__main__":
    os.chdir(ROOT)
    os.execv(sys.executable, [sys.executable, str(ROOT / "manage.py"), "swarm_up", *sys.argv[1:]])
