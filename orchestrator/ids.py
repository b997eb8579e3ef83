"""Identifiers. Run ids: UUIDs whose first 48 bits are the creation time (RFC 9562 version 7).

Every hot index is keyed by the run id first (runs, the journal, the operation ledger). With
random (version 4) ids each new run lands on a random leaf page of each of those indexes, so
once the tables outgrow the server's cache every write reads a page from disk; time-ordered
ids put new runs on the right-hand pages, which stay cached however much history there is.
The remaining 74 bits are random, so ids are still unique and not guessable in practice
(runs are owner-scoped anyway; an id is not a capability).
"""

from __future__ import annotations

import os
import socket
import time
import uuid


def new_run_id() -> uuid.UUID:
    """A version 7 UUID: 48-bit Unix milliseconds, version, 12 + 62 random bits, variant."""
    millis = time.time_ns() // 1_000_000
    rand = int.from_bytes(os.urandom(10), "big")  # 80 bits, 74 of them used
    value = (millis & ((1 << 48) - 1)) << 80
    value |= 0x7 << 76  # version 7
    value |= ((rand >> 62) & 0xFFF) << 64  # rand_a: 12 bits
    value |= 0b10 << 62  # RFC 9562 variant
    value |= rand & ((1 << 62) - 1)  # rand_b: 62 bits
    return uuid.UUID(int=value)


def default_worker_id() -> str:
    """A worker's (or reconciler's) id: host, process and a random suffix."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
