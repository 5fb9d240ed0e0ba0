"""The held-out split: which documents evaluation keeps out of training, chosen by a hash of their id."""

from __future__ import annotations

import xxhash


def is_heldout(doc_id: str, fraction: float) -> bool:
    return xxhash.xxh3_64_intdigest(doc_id.encode()) % 1_000_000 < fraction * 1_000_000


def split(by_domain: dict[str, list[str]], fraction: float) -> tuple[dict, dict]:
    """(train, heldout) ids per domain; a domain of two or more documents holds out at least one."""
    heldout: dict[str, list[str]] = {}
    train: dict[str, list[str]] = {}
    for domain, ids in sorted(by_domain.items()):
        ho = [d for d in ids if is_heldout(d, fraction)]
        if not ho and len(ids) >= 2:
            ho = [min(ids, key=lambda d: xxhash.xxh3_64_intdigest(d.encode()))]
        heldout[domain] = ho
        held = set(ho)
        train[domain] = [d for d in ids if d not in held]
    return train, heldout
