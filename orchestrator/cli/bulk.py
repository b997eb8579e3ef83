"""``orchestrator ops resolve-many`` and ``ops abandon-many``: one decision for every queue item
a filter selects, each item resolved and audited on its own.

They act through :meth:`~orchestrator.operators.Operators.resolve_many` and
:meth:`~orchestrator.operators.Operators.abandon_many`: one selection (oldest first, at most
``--limit``), a confirmation showing the count (unless ``--yes``), then one transaction and one
audit row per item. An item whose state changed after the selection is skipped and listed with
the error it met; the database failing stops the command, and the items not tried are listed
as skipped too (the same command again resolves those still waiting). Exit status: 0 when
every selected item was resolved (or none matched), 1 when any was skipped or the
confirmation was declined, 2 for bad input (nothing changed).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from orchestrator.cli import records
from orchestrator.cli.common import json_option
from orchestrator.cli.operating import (
    described,
    filter_of,
    filters,
    operator_options,
    receipt_of,
    then_of,
    then_option,
    with_operators,
)
from orchestrator.cli.options import one_of, whole
from orchestrator.cli.tables import render
from orchestrator.operators import BULK_LIMIT, MAX_BULK, UNRESOLVED, BulkSummary, Operators

EXIT_SKIPPED = 1  # the CLI's EXIT_FINDING: the command ran and reports what it could not do
WORDS = {"committed": "committed", "not_applied": "not applied", "abandoned": "abandoned"}


def register(commands: Any) -> None:
    """Add ``resolve-many`` and ``abandon-many`` to the ``ops`` group."""
    many = commands.add_parser(
        "resolve-many", help="resolve every queued operation a filter selects, each audited",
        description="Resolve every unresolved queue item matching the filter (oldest first), "
                    "each in its own transaction with its own audit row, as `ops resolve` "
                    "would. Items whose state changed meanwhile are skipped and listed.")
    kind = many.add_mutually_exclusive_group(required=True)
    kind.add_argument("--committed", action="store_true", help="the effects were applied")
    kind.add_argument("--not-applied", action="store_true", help="nothing was applied")
    many.add_argument("--receipt", metavar="JSON",
                      help="with --committed: the receipt recorded for every item")
    then_option(many)
    _options(many)
    many.set_defaults(func=cmd_resolve_many)

    abandon = commands.add_parser(
        "abandon-many", help="give up on every queued operation a filter selects",
        description="Abandon every unresolved queue item matching the filter (oldest first): "
                    "each run fails with OPERATION_ABANDONED, each item audited on its own.")
    _options(abandon)
    abandon.set_defaults(func=cmd_abandon_many)


def _options(parser: argparse.ArgumentParser) -> None:
    states = ("open", "operator", UNRESOLVED)
    parser.add_argument("--state", choices=states, type=one_of("--state", states),
                        default=UNRESOLVED,
                        help="open: lookups still to try; operator: waits for a person; "
                             "unresolved (the default): either")
    filters(parser)
    parser.add_argument("--limit", type=whole("--limit", low=1, high=MAX_BULK),
                        default=BULK_LIMIT,
                        help=f"act on at most this many, oldest first (1 to {MAX_BULK:,}; "
                             f"default {BULK_LIMIT:,})")
    parser.add_argument("--evidence", required=True, metavar="TEXT",
                        help="recorded with every item")
    parser.add_argument("--dry-run", action="store_true",
                        help="print what would be acted on; change nothing")
    parser.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    operator_options(parser, operator_required=True)
    json_option(parser)


def cmd_resolve_many(args: argparse.Namespace) -> int:
    receipt = receipt_of(args)
    then = then_of(args)
    resolution = "committed" if args.committed else "not_applied"
    return _run(args, resolution, lambda ops, operator, **options: ops.resolve_many(
        resolution=resolution, receipt=receipt, operator=operator, then=then, **options))


def cmd_abandon_many(args: argparse.Namespace) -> int:
    return _run(args, "abandoned", lambda ops, operator, **options: ops.abandon_many(
        operator=operator, **options))


def _run(args: argparse.Namespace, resolution: str, act: Any) -> int:
    where = filter_of(args)
    progress = _Progress(resolution) if sys.stderr.isatty() and not args.dry_run else None

    def confirm(selection: BulkSummary) -> bool:
        return args.yes or _ask(selection, args)

    def call(ops: Operators, operator: str) -> Any:
        return act(ops, operator, evidence=args.evidence, state=args.state, limit=args.limit,
                   dry_run=args.dry_run, confirm=confirm, progress=progress, **where)

    summary: BulkSummary = with_operators(args, call)
    if progress is not None:
        progress.finish()
    if args.json:
        records.emit({**records.bulk_summary(summary), "declined": summary.declined})
    else:
        _print(summary, args)
    return EXIT_SKIPPED if summary.skipped or summary.declined else 0


def _ask(selection: BulkSummary, args: argparse.Namespace) -> bool:
    """The confirmation, on stderr (stdout keeps the command's output, JSON included)."""
    more = " (the oldest; more match: see --limit)" if selection.more else ""
    print(f"{_verb(selection.resolution)} {_count(len(selection.matched))}{more} as "
          f"{WORDS[selection.resolution]}{_then(selection.resolution, args)}, recording the "
          f"same evidence for each as operator {args.operator}? (--dry-run lists them) "
          "[y/N] ", end="", file=sys.stderr, flush=True)
    answer = sys.stdin.readline().strip().lower()
    return answer in ("y", "yes")


def _print(summary: BulkSummary, args: argparse.Namespace) -> None:
    what = WORDS[summary.resolution]
    if not summary.matched:
        given = described(args)
        print(f"no unresolved operations match {given}" if given
              else "nothing waits in the reconciliation queue")
        return
    more = (f"\n(the first {args.limit}, oldest first: more match; see --limit)"
            if summary.more else "")
    if summary.dry_run:
        how = "" if summary.resolution == "abandoned" else f" as {what}"
        print(f"would {_verb(summary.resolution).lower()} {_count(len(summary.matched))}{how}"
              f"{_then(summary.resolution, args)} (dry run: nothing changed)")
        print(_items_table(summary) + more)
        return
    if summary.declined:
        print("not confirmed: nothing changed")
        return
    how = "" if summary.resolution == "abandoned" else f" as {what}"
    follows = _followed(summary)
    print(f"{_past(summary.resolution)} {len(summary.resolved)} of "
          f"{_count(len(summary.matched))}{how}; skipped {len(summary.skipped)}"
          + ("; what follows:\n" + "\n".join(follows) if follows else "") + more)
    if summary.skipped:
        print("\nskipped (each left as it was, unless its reason says that is not known)")
        print(render(["OP", "CODE", "REASON"],
                     [[s.item.operation_id, s.code, s.reason] for s in summary.skipped],
                     max_width=100))


FOLLOWED = {
    "resend": "its call is sent again as a new attempt",
    "fail": "its call fails with TOOL_FAILED in the workflow",
    "policy": "the engine decides: a lost attempt is sent again, else the tool's retry policy",
    "resume": "its run goes on with the receipt",
    "run_failed": "its run fails with OPERATION_ABANDONED",
    "waits": "its run still waits for its other unknown operations (in parentheses)",
    "cancelled": "its run ends cancelled, as was requested (nothing is sent again)",
    "ended": "its run had already ended: only the ledger changed",
}
"""What a resolved item's run does next (its ``then``), in the report after the action."""
SHOWN_IDS = 20  # operations named per line of the report; --json names every one


def _followed(summary: BulkSummary) -> list[str]:
    """The report's lines on what each resolution led its run to: one line per next step
    (in the order of :data:`FOLLOWED`), naming its operations by id."""
    groups: dict[str, list[str]] = {then: [] for then in FOLLOWED}
    for op in sorted(item.operation_id for item in summary.resolved):
        followed = summary.followed.get(op)
        if followed is None or followed.then is None:
            continue
        name = str(op)
        if followed.waits_for:
            name += f" ({', '.join(str(other) for other in followed.waits_for)})"
        groups.setdefault(followed.then, []).append(name)
    lines = []
    for then, names in groups.items():
        if not names:
            continue
        shown = ", ".join(names[:SHOWN_IDS]) + (
            f" and {len(names) - SHOWN_IDS} more (--json lists each)"
            if len(names) > SHOWN_IDS else "")
        word = "operation" if len(names) == 1 else "operations"
        lines.append(f"  {FOLLOWED.get(then, then)}: {word} {shown}")
    return lines


def _then(resolution: str, args: argparse.Namespace) -> str:
    """What a not-applied resolution leads to, said before it is made (the dry run, the
    question): the calls are sent again unless ``--then fail``."""
    if resolution != "not_applied":
        return ""
    if (getattr(args, "then", None) or "resend") == "resend":
        return ", then send each call again as a new attempt with a new key (--then resend)"
    return ", then fail each call with TOOL_FAILED in its workflow (--then fail)"


def _items_table(summary: BulkSummary) -> str:
    return render(["OP", "RUN", "TOOL", "ITEM", "KEY", "OWNER", "SINCE"],
                  [[i.operation_id, i.run_id, i.tool_name, i.item_state, i.idempotency_key,
                    f"{i.tenant}/{i.principal}", i.created_at] for i in summary.matched])


def _verb(resolution: str) -> str:
    return "Abandon" if resolution == "abandoned" else "Resolve"


def _past(resolution: str) -> str:
    return "abandoned" if resolution == "abandoned" else "resolved"


def _count(n: int) -> str:
    return f"{n} operation" + ("" if n == 1 else "s")


class _Progress:
    """A counter on stderr (a terminal only), rewritten in place after each item."""

    def __init__(self, resolution: str) -> None:
        self.word = _past(resolution)
        self.shown = False

    def __call__(self, done: int, total: int) -> None:
        print(f"\r{self.word} {done}/{total}", end="", file=sys.stderr, flush=True)
        self.shown = True

    def finish(self) -> None:
        if self.shown:
            print(file=sys.stderr, flush=True)
