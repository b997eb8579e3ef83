"""Two deploys of one application, for ``schedules delete --app`` in CLI tests:
``declaring`` declares the schedule ``nightly``; ``removed``, the next deploy, registers the
same workflow and no longer declares it."""

from __future__ import annotations

from typing import Any

from orchestrator import Orchestrator, Owner

OWNER = Owner(tenant="acme", principal="scheduler")
declaring = Orchestrator(default_owner=OWNER)
removed = Orchestrator(default_owner=OWNER)


@declaring.schedule("nightly", cron="0 3 * * *")
@declaring.workflow()
async def report(ctx: Any, data: Any) -> Any:
    return data


removed.workflow(name="report")(report.fn)
