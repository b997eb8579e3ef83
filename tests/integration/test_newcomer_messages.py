"""What a newcomer meets first when something is not yet right: each refusal names the fix."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from orchestrator.errors import InvalidRequest
from tests.clitools import cli_env, command
from tests.integration.conftest import running, wait_for
from tests.integration.test_ops_cli import cli

SHOP = '''from orchestrator import Orchestrator, ToolContext

app = Orchestrator()
other = Orchestrator()


@app.tool()
async def charge(ctx: ToolContext, *, cents: int) -> int:
    return cents
'''


def _worker(tmp_path: Path, spec: str, database_url: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*command(), "worker", "--app", spec], cwd=tmp_path,
                          env=cli_env(database_url), capture_output=True, text=True,
                          timeout=60, check=False)


def test_an_app_attribute_the_module_lacks_is_named_with_the_ones_it_has(
        tmp_path: Path, migrated_database_url: str) -> None:
    (tmp_path / "shop.py").write_text(SHOP)
    missing = _worker(tmp_path, "shop:appp", migrated_database_url)
    assert (missing.returncode, missing.stderr) == (
        2, "orchestrator: error: CONFIGURATION_ERROR: --app shop:appp: module 'shop' has no "
           "attribute 'appp'; its orchestrator.Orchestrator instances: app, other\n")


def test_an_app_attribute_of_another_kind_says_what_it_is(
        tmp_path: Path, migrated_database_url: str) -> None:
    (tmp_path / "shop.py").write_text(SHOP)
    tool = _worker(tmp_path, "shop:charge", migrated_database_url)
    assert (tool.returncode, tool.stderr) == (
        2, "orchestrator: error: CONFIGURATION_ERROR: --app shop:charge is a Tool, not an "
           "orchestrator.Orchestrator instance; the module's instances: app, other\n")
    (tmp_path / "empty.py").write_text("app = None\n")
    none = _worker(tmp_path, "empty:app", migrated_database_url)
    assert (none.returncode, none.stderr) == (
        2, "orchestrator: error: CONFIGURATION_ERROR: --app empty:app is None, not an "
           "orchestrator.Orchestrator instance; the module defines none\n")


def test_a_missing_owner_says_how_to_give_one(make_app) -> None:  # type: ignore[no-untyped-def]
    app = make_app(default_owner=None)

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        return data

    with pytest.raises(InvalidRequest) as refused:
        app.submit(wf, {})
    assert refused.value.path == "owner"
    assert str(refused.value) == (
        "INVALID_REQUEST: owner is required: pass owner=Owner(tenant=..., principal=...), or "
        "configure Orchestrator(default_owner=Owner(...)) for a single-tenant app")


def test_a_module_that_fails_to_import_is_the_app_s_error_not_an_internal_one(
        tmp_path: Path, migrated_database_url: str) -> None:
    """The user's own module raising on import (a typo, a syntax error) is a configuration
    error naming the exception and where it was raised, not ``INTERNAL`` (exit 70), whose
    traceback only ``ORCHESTRATOR_DEBUG=1`` would show."""
    (tmp_path / "typo.py").write_text(
        "from orchestrator import Orchestrator\napp = Orchestrator()\nundefined_name\n")
    typo = _worker(tmp_path, "typo:app", migrated_database_url)
    assert (typo.returncode, typo.stderr) == (
        2, "orchestrator: error: CONFIGURATION_ERROR: importing 'typo' for --app raised "
           f"NameError: name 'undefined_name' is not defined ({tmp_path / 'typo.py'}, line 3)\n")
    (tmp_path / "syntax.py").write_text("def f(:\n    pass\n")
    syntax = _worker(tmp_path, "syntax:app", migrated_database_url)
    assert syntax.returncode == 2
    assert syntax.stderr.startswith(
        "orchestrator: error: CONFIGURATION_ERROR: importing 'syntax' for --app raised "
        "SyntaxError: ")
    assert f"({tmp_path / 'syntax.py'}, line 1)\n" in syntax.stderr
    # Another exception's text may hold what the module handled: its type and place only.
    (tmp_path / "loud.py").write_text(
        "raise RuntimeError('cannot reach postgresql://app:s3cret@db/app')\n")
    loud = _worker(tmp_path, "loud:app", migrated_database_url)
    assert (loud.returncode, loud.stderr) == (
        2, "orchestrator: error: CONFIGURATION_ERROR: importing 'loud' for --app raised "
           f"RuntimeError ({tmp_path / 'loud.py'}, line 1); run again with "
           "ORCHESTRATOR_DEBUG=1 to see its message and traceback\n")
    debug = subprocess.run([*command(), "worker", "--app", "loud:app"], cwd=tmp_path,
                           env={**cli_env(migrated_database_url), "ORCHESTRATOR_DEBUG": "1"},
                           capture_output=True, text=True, timeout=60, check=False)
    assert debug.returncode != 0 and "s3cret" in debug.stderr and "Traceback" in debug.stderr


def test_a_dependency_the_module_lacks_is_not_blamed_on_the_directory(
        tmp_path: Path, migrated_database_url: str) -> None:
    """The module was found: its own import failed. Saying to run from the module's directory
    sent the user looking in the wrong place."""
    (tmp_path / "needs.py").write_text(
        "import psp_client_not_installed\nfrom orchestrator import Orchestrator\n"
        "app = Orchestrator()\n")
    needs = _worker(tmp_path, "needs:app", migrated_database_url)
    assert (needs.returncode, needs.stderr) == (
        2, "orchestrator: error: CONFIGURATION_ERROR: importing 'needs' for --app failed: No "
           "module named 'psp_client_not_installed' (a module it imports: install that in this "
           "environment, or put its directory on PYTHONPATH)\n")
    missing = _worker(tmp_path, "absent:app", migrated_database_url)
    assert (missing.returncode, missing.stderr) == (
        2, "orchestrator: error: CONFIGURATION_ERROR: cannot import 'absent' for --app: No "
           "module named 'absent'; run the command from the directory that holds the module, "
           "or put that directory on PYTHONPATH\n")


async def test_ops_list_says_what_its_item_states_mean_and_what_to_run_next(
        make_app, sql, migrated_database_url) -> None:  # type: ignore[no-untyped-def]
    """A newcomer reading the queue met ``ITEM operator`` beside ``OPERATION unknown`` with
    nothing to say that one waits for a person, nor which command shows it."""
    app = make_app()

    @app.tool()
    async def ship(ctx, *, parcel):  # type: ignore[no-untyped-def]
        raise ConnectionResetError("lost after sending")

    @app.workflow()
    async def send(ctx, parcel):  # type: ignore[no-untyped-def]
        return await ctx.call(ship, parcel=parcel)

    async with running(app):
        await app.submit_async(send, "p1")
        await wait_for(lambda: sql("SELECT 1 FROM orchestrator.runs "
                                   "WHERE status = 'needs_reconciliation'"))
    code, out, err = await cli(migrated_database_url, "ops", "list")
    assert code == 0, err
    # under the table, folded to 100 columns like `workers list`'s note, not one long line
    note = out.split("\n(ITEM open: ", 1)[1].splitlines()
    assert all(len(line) <= 100 for line in note) and len(note) > 1, note
    assert "(ITEM open: " + " ".join(note) == (
        "(ITEM open: it waits for a running `orchestrator reconciler` to ask the tool's "
        "lookup (a tool without one goes to operators); operator: it waits for a person. "
        "Either may be resolved by hand: `orchestrator ops show OP` shows one and the "
        "commands that settle it)")
    (op,) = [row["id"] for row in sql("SELECT id FROM orchestrator.operations")]
    # An open item with no reconciler running stays open: `ops show` says who acts next.
    code, out, err = await cli(migrated_database_url, "ops", "show", str(op))
    assert code == 0, err
    (line,) = [line for line in out.splitlines() if line.startswith("lookups:")]
    assert line.startswith("lookups:    0 so far; the next is due at 20"), line
    assert line.endswith("Z, made by a running `orchestrator reconciler --app MODULE:ATTR` "
                         "(nothing asks the lookup while none runs; a tool without one goes "
                         "to operators)"), line
    code, _, err = await cli(migrated_database_url, "ops", "resolve", str(op), "--not-applied",
                             "--then", "fail", "--evidence", "none shipped",
                             "--operator", "alice")
    assert code == 0, err
    code, out, err = await cli(migrated_database_url, "ops", "list", "--state", "resolved")
    assert code == 0 and "ops show OP" not in out  # nothing waits: nothing to explain
