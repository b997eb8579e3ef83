"""Versions of two workflows' code, for the tests of patches and of the replay check (and for
``--app`` in its CLI tests: ``tests.integration.versioned_apps:early`` …).

``order`` changes its charge: ``old`` charges with ``charge_old``; ``patched`` puts the new
``charge_new`` behind ``ctx.patched("new-charge")``; ``deprecated`` keeps only the new one
after ``ctx.deprecate_patch``; ``early`` removes the patch too early (the new charge alone).
Each waits for the event ``go`` between its charge and its shipping, so a run parks there.

``steps`` calls a, b, sleeps, calls c; ``reordered``, ``renamed`` (``a2`` for ``a``),
``no_sleep`` and ``compatible`` (new code that replays the same history) change it.

Every tool counts its calls in :data:`CALLS` (this process), so a test can say that a check
dispatched nothing.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from orchestrator import Orchestrator, Owner

OWNER = Owner(tenant="acme", principal="alice")
CALLS: Counter[str] = Counter()
VARIANTS = ("old", "patched", "deprecated", "early", "reordered", "renamed", "no_sleep",
            "compatible")


def build(variant: str, app: Orchestrator | None = None) -> Orchestrator:
    """``variant``'s code registered on ``app`` (by default a new app on the environment's
    database)."""
    if app is None:
        app = Orchestrator(default_owner=OWNER, lease_ttl=5.0)

    def tool(name: str) -> Any:
        @app.tool(name=name)
        async def counted(ctx, *, n):  # type: ignore[no-untyped-def]
            CALLS[name] += 1
            return {name: n}

        return counted

    for name in ("charge_old", "charge_new", "ship", "a", "a2", "b", "c", "d"):
        tool(name)

    @app.workflow()
    async def order(ctx, n):  # type: ignore[no-untyped-def]
        if variant in ("old", "reordered", "renamed", "no_sleep", "compatible"):
            await ctx.call("charge_old", n=n)
            branch = "old"
        elif variant == "patched":
            if ctx.patched("new-charge"):
                await ctx.call("charge_new", n=n)
                branch = "new"
            else:
                await ctx.call("charge_old", n=n)
                branch = "old"
        else:
            if variant == "deprecated":
                ctx.deprecate_patch("new-charge")
            await ctx.call("charge_new", n=n)
            branch = "new"
        await ctx.wait_for_event("go")
        await ctx.call("ship", n=n)
        return branch

    @app.workflow()
    async def steps(ctx, n):  # type: ignore[no-untyped-def]
        if variant == "reordered":
            await ctx.call("b", n=n)
            await ctx.call("a", n=n)
        else:
            await ctx.call("a2" if variant == "renamed" else "a", n=n)
            total = n * 2 if variant == "compatible" else n  # not a command: free to change
            await ctx.call("b", n=n)
        if variant != "no_sleep":
            await ctx.sleep(0.01)
        await ctx.call("c", n=n)
        if variant == "compatible":
            ctx.log.info("total %s", total)
            if ctx.patched("extra-step"):
                await ctx.call("d", n=n)
        return n

    return app


old, patched, deprecated, early, reordered, renamed, no_sleep, compatible = (
    build(v) for v in VARIANTS)
