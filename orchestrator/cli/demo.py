"""``orchestrator demo``: the whole promise in under a minute, in a database of its own.

Starts a worker, submits sample runs (effects, a durable timer, an event, a child run), kills
the worker with SIGKILL in the middle, starts another that finishes every run, and prints what
happened, counting effects in a sink outside the database.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from orchestrator.cli.common import database_target
from orchestrator.cli.options import whole
from orchestrator.cli.tables import render
from orchestrator.db import migrate
from orchestrator.db.config import ENV_URL, demo_target, display_url, mask_url


def register(subparsers: Any) -> None:
    demo = subparsers.add_parser(
        "demo", help="run sample workflows, kill a worker mid-run, show every effect once",
        description="Run sample workflows, kill a worker mid-run, and show every effect applied "
        "once. The demo runs in a database of its own beside the configured one (its name and "
        "_demo, created if missing; orchestrator_demo on the embedded server), so that its runs "
        "never mix with an application's; a database given with --database-url is used as it "
        "is.")
    demo.add_argument("--runs", type=whole("--runs", low=1), default=6,
                      help="order runs to submit (default 6)")
    # exit status: 0 when every run succeeded and no effect was applied twice, else 1
    demo.set_defaults(func=cmd_demo)


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def _start(role: str, label: str, env: dict[str, str], logs: Path) -> subprocess.Popen[bytes]:
    extra = ["--concurrency", "8", "--lease-ttl", "3"] if role == "worker" else []
    with open(logs / f"{role}-{label}.log", "wb") as log:  # the child keeps its own copy
        return subprocess.Popen(
            [sys.executable, "-m", "orchestrator", role, "--app", "orchestrator.demo:app",
             *extra], env=env, stdout=log, stderr=subprocess.STDOUT)


def _wait(predicate: Any, timeout: float, what: str) -> None:
    give_up = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > give_up:
            raise TimeoutError(f"the demo timed out waiting for {what}")
        time.sleep(0.1)


def cmd_demo(args: argparse.Namespace) -> int:
    target = database_target(args)
    if target.source != "argument":  # a database named for the demo is taken as it is
        target = demo_target(target)
    say(f"database: {display_url(target.url)}"
        + ("" if target.source == "argument" else " (the demo's own, apart from any app's)"))
    migrate.upgrade(target)
    os.environ[ENV_URL] = target.url
    sink = Path(tempfile.mkdtemp(prefix="orchestrator-demo-"))
    os.environ["ORCHESTRATOR_DEMO_SINK"] = str(sink)
    env = dict(os.environ)

    from orchestrator import demo  # after the environment names the database and the sink

    app = demo.app
    worker_a = _start("worker", "A", env, sink)
    say(f"worker A started (pid {worker_a.pid})")
    handles = [app.submit(demo.order, {"sku": f"sku-{i}", "quantity": 1 + i % 3,
                                       "customer": f"c{i}@example.com"})
               for i in range(args.runs)]
    approval = app.submit(demo.refund_with_approval, {"customer": "c0@example.com", "cents": 500})
    handles += [approval, app.submit(demo.bundle, {"customer": "c9@example.com"})]
    say(f"submitted {len(handles)} runs: {args.runs} orders, one refund that waits for an "
        "approval event, one bundle with a child run")
    pids: dict[str, str] = {str(worker_a.pid): "A"}
    worker_b = reconciler = None
    try:
        _wait(lambda: len(demo.read_effects(sink)) >= 4
              and any(h.status() == "running" for h in handles), 30, "runs in flight")
        worker_a.send_signal(signal.SIGKILL)
        worker_a.wait()
        held = sum(1 for h in handles if h.status() == "running")
        say(f"worker A killed with SIGKILL after {len(demo.read_effects(sink))} effects; "
            f"it held {held} run(s) mid-flight")
        worker_b = _start("worker", "B", env, sink)
        reconciler = _start("reconciler", "R", env, sink)
        pids[str(worker_b.pid)] = "B"
        say(f"worker B started (pid {worker_b.pid}): it sees that A is dead (its liveness lock "
            "is gone), re-queues A's runs and replays them from their journals; a reconciler "
            "asks the carrier about any shipment whose outcome A took with it")
        _wait(lambda: approval.status() == "waiting" and approval.info().waiting_for is not None
              and "approval" in (approval.info().waiting_for or ""), 30, "the approval wait")
        app.send_event(approval.id, "approval", {"ok": True}, event_key="demo-approval")
        app.send_event(approval.id, "approval", {"ok": True}, event_key="demo-approval")
        say("sent the approval event twice with one event key (it is delivered once)")
        finished = ("succeeded", "failed", "cancelled")
        _wait(lambda: all(h.status() in finished for h in handles), 45, "every run to finish")
    finally:
        for proc in (worker_a, worker_b, reconciler):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
    ok = _report(app, handles, sink, pids, mask_url(target.url))
    app.close()
    if ok:
        shutil.rmtree(sink, ignore_errors=True)
        return 0
    print(f"the workers' logs and the effects are kept in {sink}")
    return 1


def _report(app: Any, handles: list[Any], sink: Path, pids: dict[str, str], url: str) -> bool:
    from orchestrator import demo

    effects = demo.read_effects(sink)
    by_key = collections.Counter(e["key"] for e in effects)
    dedup_path = sink / "dedup.jsonl"
    deduplicated = len(dedup_path.read_text().splitlines()) if dedup_path.exists() else 0
    rows, resent = [], 0
    for run_id, workflow, status in _runs_and_children(app, handles):
        run_effects = [e for e in effects if e["key"].startswith(str(run_id))]
        operations = _operations(app, run_id)
        resent += sum(1 for o in operations if o["attempt"] > 1)
        workers = sorted({pids.get(o["worker_id"].split(":")[1], "?") for o in operations
                          if o.get("worker_id")})
        rows.append([str(run_id), workflow, status, len(run_effects), ",".join(workers) or "-"])
    print()
    print(render(["RUN", "WORKFLOW", "STATUS", "EFFECTS", "WORKERS"], rows))
    print()
    duplicates = sum(1 for n in by_key.values() if n > 1)
    print(f"effects applied: {len(effects)}; applied twice: {duplicates} (the shipments are "
          f"consequential and not deduplicated by the carrier, so a repeat would show here); "
          f"calls made again after the crash: {resent} (reads repeated, idempotent calls re-sent "
          f"with their key: the provider had already applied {deduplicated} of those and "
          f"answered with its saved receipt)")
    resolved = _lookups(app)
    if resolved:
        print(f"operations whose outcome died with worker A and a lookup settled: {resolved}")
    ok = duplicates == 0 and all(r[2] == "succeeded" for r in rows)
    print("every run finished and every effect was applied exactly once"
          if ok else "SOMETHING IS WRONG: see the table above")
    print(f"inspect a run: orchestrator --database-url '{url}' runs show {handles[0].id}")
    return ok


def _lookups(app: Any) -> int:
    async def fetch() -> int:
        items = await app.operators.list_items(operator="demo", state="resolved")
        return len(items)

    result: int = app._portal.call(fetch())
    return result


def _operations(app: Any, run_id: Any) -> list[dict[str, Any]]:
    from orchestrator import admin

    async def fetch() -> list[dict[str, Any]]:
        return (await admin.show_run(app.database, run_id)).operations

    result: list[dict[str, Any]] = app._portal.call(fetch())
    return result


def _runs_and_children(app: Any, handles: list[Any]) -> list[tuple[Any, str, str]]:
    """(run id, workflow, status) of the submitted runs, each followed by its child runs (their
    effects count too)."""
    from orchestrator import admin

    async def children(run_id: Any) -> list[dict[str, Any]]:
        return await admin.list_runs(app.database, parent=run_id, limit=1000)

    out = []
    for handle in handles:
        info = handle.info()
        out.append((handle.id, info.workflow, info.status))
        out += [(r["id"], f"  {r['workflow_name']} (child)", r["status"])
                for r in reversed(app._portal.call(children(handle.id)))]
    return out
