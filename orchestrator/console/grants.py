"""What an operator may do in the console: the grants, checked once at start (pure, no I/O).

=============  ======================================================================
``read``       every page and every ``GET /api/...`` (implied by each other grant)
``resolve``    resolve or abandon one operation of the reconciliation queue
``bulk``       resolve or abandon the queued operations a filter or a list selects (with
               ``resolve``: a bulk action is many resolutions)
``cancel``     cancel a run
``incidents``  read protected diagnostics: the incidents, what lookups said
``metrics``    scrape ``/metrics``: the gauges read from the database (unknown operations,
               the operator queue, queued runs), counted over every tenant
``queues``     pause, resume or change the limits of a queue (docs/flow.md); a queue is
               shared by every tenant, so only an operator without tenant scopes may
=============  ======================================================================

Grants say what kind of thing an operator may do; the application's ``operator_scopes`` say on
which tenants (an operator outside them sees nothing at all), and its ``incident_readers``, if
set, must list the operator too for ``incidents`` to mean anything. The console asks
:class:`~orchestrator.operators.Operators` for every read and action, so the scopes, the
checks and the audit are the CLI's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from orchestrator.errors import ConfigurationError, Forbidden, InvalidRequest
from orchestrator.text import check_operator

GRANTS = ("read", "resolve", "bulk", "cancel", "incidents", "metrics", "queues")
ALL = "all"
"""Shorthand for every grant (``--grant alice=all``)."""

GrantSource = Mapping[str, Iterable[str]] | Callable[[str], Iterable[str]]
"""What a host passes as ``grants``: operator name → grants, or a function of the name."""


def check_grant_list(owner: str, grants: Any) -> frozenset[str]:
    """One operator's grants as a set (``read`` added when any is given), or
    ``CONFIGURATION_ERROR`` naming the unknown grant."""
    if isinstance(grants, str | bytes) or not isinstance(grants, Iterable):
        raise ConfigurationError(f"the grants of {owner!r} must be a list of grant names "
                                 f"({', '.join(GRANTS)}), not a single string")
    names: set[str] = set()
    for grant in grants:
        if grant == ALL:
            names.update(GRANTS)
        elif grant in GRANTS:
            names.add(grant)
        else:
            raise ConfigurationError(f"{grant!r} (for {owner!r}) is not a grant: use "
                                     f"{', '.join(GRANTS)} or {ALL}")
    if names:
        names.add("read")
    return frozenset(names)


def check_grants(grants: GrantSource | None) -> Callable[[str], frozenset[str]]:
    """The host's ``grants`` as a function of the operator's name.

    None: every operator the host authenticates may read, and nothing more. A mapping is
    checked now (names and grants); an operator it does not list has no grant at all. A
    function is called per request and its answer checked then."""
    if grants is None:
        return lambda _operator: frozenset({"read"})
    if callable(grants):
        source = grants

        def asked(operator: str) -> frozenset[str]:
            return check_grant_list(operator, source(operator))

        return asked
    if not isinstance(grants, Mapping):
        raise ConfigurationError("grants must map operator names to lists of grants, or be "
                                 "a function of the operator's name")
    table: dict[str, frozenset[str]] = {}
    for name, listed in grants.items():
        try:
            check_operator(name)
        except InvalidRequest as exc:
            raise ConfigurationError(f"grants: {name!r} is not a valid operator name "
                                     f"({exc.message})") from None
        table[name] = check_grant_list(name, listed)
    return lambda operator: table.get(operator, frozenset())


def parse_grant_option(text: str) -> tuple[str, list[str]]:
    """``alice=read,resolve`` (the ``--grant`` option) as ``("alice", ["read", "resolve"])``."""
    name, sep, listed = text.partition("=")
    if not sep or not name or not listed:
        raise ConfigurationError(f"--grant {text!r}: use NAME=GRANT[,GRANT...], e.g. "
                                 "alice=read,resolve")
    return name, [g.strip() for g in listed.split(",") if g.strip()]


@dataclass(frozen=True)
class Access:
    """Who sends a request and what they may do. ``via`` is how they were identified:
    ``bearer`` (the ``Authorization`` header), ``session`` (the console's login cookie) or
    ``host`` (the host's ``authenticate``)."""

    operator: str
    grants: frozenset[str]
    via: str

    def may(self, grant: str) -> bool:
        assert grant in GRANTS, grant
        return grant in self.grants

    def need(self, *grants: str) -> None:
        """``FORBIDDEN`` naming the first grant of ``grants`` the operator lacks."""
        for grant in grants:
            if not self.may(grant):
                raise Forbidden(f"operator {self.operator!r} lacks the {grant!r} grant")
