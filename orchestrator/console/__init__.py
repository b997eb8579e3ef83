"""The operator console: every run and every uncertain effect in a browser, resolved there with
evidence (docs/console.md). Needs the ``console`` extra: ``pip install 'orchestrator[console]'``.

``app.console(authenticate=..., grants=...)`` (:meth:`orchestrator.Orchestrator.console`)
returns the ASGI application a host mounts; ``orchestrator console --app module:app`` serves it
on its own, with a bearer token.
"""

from orchestrator.console.grants import GRANTS, Access
from orchestrator.console.server import create_console

__all__ = ["GRANTS", "Access", "create_console"]
