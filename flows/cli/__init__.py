"""The `r1flow` command line (`flows.cli:main`, `python -m flows.cli`): the parser, `main` and the run and listing
commands (app.py), the server commands (server_commands.py), the single-stage and deployment commands
(deploy_commands.py), what they print (output.py). The top of flows/: nothing else of flows/ imports it."""

from flows.cli.app import main

__all__ = ["main"]
