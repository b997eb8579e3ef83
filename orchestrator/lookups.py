"""What a tool's ``lookup`` answers about an operation whose outcome is unknown (CONTRACT C8).

A lookup is read-only: it asks the provider whether the request with ``ctx.idempotency_key``
(and these arguments) was applied, and answers with one of these.

The text a lookup gives (``NotApplied.evidence``, ``StillUnknown.reason``) is the tool's own and
may hold what the provider echoed (a URL with a key in it): it is kept with the operation's
incidents, for incident readers, and never logged or shown in other operator views, which show
the answer, its attempt and its time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Committed:
    """The provider applied the request; ``receipt`` is what the tool would have returned."""

    receipt: Any


@dataclass(frozen=True)
class NotApplied:
    """The provider proves that nothing was applied, now and for good.

    The call may be sent again with a new key (an attempt its worker lost is, at once), so the
    answer must be final at the provider: a request with this key that arrives later (from a
    worker that was paused mid-call) must never be applied. Answer ``NotApplied`` only if the
    provider refuses such a late request, or if the lookup itself voids the key (cancels the
    pending request, marks the key used); otherwise answer ``StillUnknown``."""

    evidence: str = ""


@dataclass(frozen=True)
class StillUnknown:
    """The provider cannot tell yet; the reconciler asks again later, then hands it over."""

    reason: str = ""


LookupAnswer = Committed | NotApplied | StillUnknown
