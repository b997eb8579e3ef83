"""The code's migrations as revisions: the folder they are in, the head, and every revision
they know. Apart from :mod:`orchestrator.db.migrate` so that the storage layer can tell a schema
behind the code from one that is not (:func:`orchestrator.db.database.behind_at`) without
importing the commands that migrate."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from alembic.script import ScriptDirectory

from orchestrator.errors import DatabaseError

__all__ = ["head_revision", "known_revisions", "script_location"]


def script_location() -> Path:
    """The migrations folder, whether running from a checkout or an installed package.

    Installed (a wheel, or the link tree of ``make install``'s editable install), the folder is
    the package ``orchestrator._migrations``. A checkout imported as it is (the repository root
    on ``sys.path``, as the tests and ``python -m orchestrator`` from the root have it) has no
    such package: its ``migrations/`` folder, beside the package, is the same scripts.
    """
    try:
        return Path(str(resources.files("orchestrator._migrations")))
    except ModuleNotFoundError:
        checkout = Path(__file__).resolve().parents[2] / "migrations"
        if not (checkout / "env.py").is_file():
            raise
        return checkout


def head_revision() -> str:
    heads = ScriptDirectory(str(script_location())).get_heads()
    if len(heads) != 1:  # pragma: no cover - guarded by the migration tests
        raise DatabaseError(f"the migrations have {len(heads)} heads; expected exactly one")
    return heads[0]


def known_revisions() -> set[str]:
    script = ScriptDirectory(str(script_location()))
    return {rev.revision for rev in script.walk_revisions()}
