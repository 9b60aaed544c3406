"""`python -m webapp.serve [daphne arguments]`: daphne with secrets redacted from everything it prints.

Daphne writes its access log (request paths, so tracker passkeys) straight to stdout, outside logging;
stdout and stderr are wrapped in `agent.logsafe.RedactingStream` before daphne starts, so the access
log, Django's logging (whose handlers also carry the filter, see settings.LOGGING) and any stray print
are redacted alike. Request bodies are bounded before they are read (webapp.core.serverlimit). `make up`
and the integration harness start the web server this way.
"""

from __future__ import annotations

import sys

from agent.eventloop import use_loop_policy
from agent.logsafe import RedactingStream


def main() -> None:
    sys.stdout = RedactingStream(sys.stdout)
    sys.stderr = RedactingStream(sys.stderr)
    # daphne's Twisted reactor on uvloop where installed, as the agents' loops: it creates its loop when
    # daphne.server is first imported, so before that. The web's per-token work is mostly loop turns.
    use_loop_policy()
    from daphne.cli import CommandLineInterface  # type: ignore[import-untyped]  # daphne ships no types

    from webapp.core import serverlimit

    serverlimit.install()  # bodies past their limit refused at header time, never read (issue 33)
    CommandLineInterface.entrypoint()


if __name__ == "__main__":
    main()
