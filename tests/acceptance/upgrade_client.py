"""A client of tests/acceptance/upgrade_app.py for the engine a subprocess imports.

The upgrade test runs it with an older engine on ``PYTHONPATH`` to submit and watch runs
through that engine's public API (``ORCHESTRATOR_DATABASE_URL`` names the database):

- ``engine``: prints where ``orchestrator`` and the app were imported from (JSON);
- ``submit NAME=INPUT ...``: submits a run of each workflow with its JSON input and prints
  their ids (a JSON list, in the order given);
- ``wait RUN_ID=STATUS ... [--timeout S]``: waits until every run has that status; exits 1
  saying where each run is if they do not in time (or one ends otherwise);
- ``journals RUN_ID ...``: prints each run's journal (JSON: run id to its entries).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import orchestrator
from tests.acceptance import upgrade_app
from tests.acceptance.upgrade_app import app

TERMINAL = ("succeeded", "failed", "cancelled")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="upgrade_client")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("engine")
    submit = commands.add_parser("submit")
    submit.add_argument("runs", nargs="+", metavar="NAME=INPUT")
    wait = commands.add_parser("wait")
    wait.add_argument("runs", nargs="+", metavar="RUN_ID=STATUS")
    wait.add_argument("--timeout", type=float, default=30.0)
    journals = commands.add_parser("journals")
    journals.add_argument("runs", nargs="+", metavar="RUN_ID")
    args = parser.parse_args(argv)
    try:
        if args.command == "engine":
            print(json.dumps({"orchestrator": orchestrator.__file__,
                              "app": upgrade_app.__file__}))
            return 0
        if args.command == "submit":
            ids = []
            for spec in args.runs:
                name, _, text = spec.partition("=")
                ids.append(str(app.submit(name, json.loads(text or "{}")).id))
            print(json.dumps(ids))
            return 0
        if args.command == "wait":
            return _wait(dict(spec.split("=", 1) for spec in args.runs), args.timeout)
        documents: dict[str, Any] = {
            run_id: [e.model_dump(mode="json") for e in app.get_run(run_id).journal()]
            for run_id in args.runs}
        print(json.dumps(documents))
        return 0
    finally:
        app.close()


def _wait(wanted: dict[str, str], timeout: float) -> int:
    give_up = time.monotonic() + timeout
    while True:
        now = {run_id: app.get_run(run_id).status() for run_id in wanted}
        if now == wanted:
            return 0
        ended = {r: s for r, s in now.items() if s in TERMINAL and s != wanted[r]}
        if ended or time.monotonic() > give_up:
            print(json.dumps({"wanted": wanted, "status": now}), file=sys.stderr)
            return 1
        time.sleep(0.05)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
