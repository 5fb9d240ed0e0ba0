"""Sources cut into units a shard reads whole, dealt out to shards so that shards joined in rank order read
the corpus in order: what lets ingest run sharded with the same bytes out as one process."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from moeflow.configs import Format
from moeflow.ingest import lines, parquet
from moeflow.ingest.resolve import ResolvedSource

SPAN_BYTES = 64 << 20  # a plain jsonl file larger than this is read by several shards, this much each


@dataclass(frozen=True)
class Unit:
    """A piece of one source that a shard reads whole: files `[lo, hi)` of the source's sorted list, or of
    one file its row groups `[lo, hi)` (parquet) or the lines that start in bytes `[lo, hi)` (plain jsonl);
    `size` (bytes on disk, estimated for row groups) balances shards."""

    source: int
    files: tuple[int, int]
    groups: tuple[int, int] | None = None
    size: int = 0
    span: tuple[int, int] | None = None

    @property
    def first(self) -> bool:
        """Whether the unit holds its file's start (so the shard reading it counts the file)."""
        return (self.groups or self.span or (0,))[0] == 0

    def join(self, other: Unit) -> Unit | None:
        """This unit and the next one of the same file as one, or None when they are not such."""
        if (self.source, self.files) != (other.source, other.files):
            return None
        if self.groups and other.groups:
            return replace(self, groups=(self.groups[0], other.groups[1]), size=self.size + other.size)
        if self.span and other.span:
            return replace(self, span=(self.span[0], other.span[1]), size=self.size + other.size)
        return None


def units(sources: list[ResolvedSource]) -> list[Unit]:
    """Every source cut into units, in corpus order: a file each, a parquet file's row groups each, a plain
    jsonl file's `SPAN_BYTES` each, and a source with `max_docs` (jsonl, parquet) whole (its cap counts
    records across files). A compressed file is one unit: it cannot be entered part-way."""
    out = []
    for s, rs in enumerate(sources):
        sizes = [_size(f) for f in rs.files]
        if rs.config.max_docs and rs.config.format != Format.text:
            out.append(Unit(s, (0, len(rs.files)), None, sum(sizes)))
            continue
        for i, (path, size) in enumerate(zip(rs.files, sizes, strict=True)):
            groups = parquet.row_groups(path) if rs.config.format == Format.parquet else []
            plain = rs.config.format == Format.jsonl and path.suffix not in lines.COMPRESSED
            if len(groups) > 1:
                total = sum(groups) or 1
                out += [Unit(s, (i, i + 1), (g, g + 1), size * n // total) for g, n in enumerate(groups)]
            elif plain and size > SPAN_BYTES:
                cuts = [*range(0, size, SPAN_BYTES), size]
                out += [Unit(s, (i, i + 1), size=hi - lo, span=(lo, hi)) for lo, hi in zip(cuts, cuts[1:])]
            else:
                out.append(Unit(s, (i, i + 1), size=size))
    return out


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def assign(plan: list[Unit], shard: tuple[int, int]) -> list[Unit]:
    """The units of shard `rank` of `world_size`: a contiguous run of the plan, cut where the running size
    passes each 1/world_size of the total (a unit goes where its middle falls), so shards joined in rank
    order read the corpus in order; consecutive pieces of one file are read as one."""
    rank, world = shard
    if not 0 <= rank < world:
        raise ValueError(f"shard rank {rank} is not in [0, {world})")
    total, done, mine = sum(u.size for u in plan) or 1, 0, []
    for u in plan:
        owner = min(world - 1, (2 * done + u.size) * world // (2 * total))
        done += u.size
        if owner != rank:
            continue
        joined = mine[-1].join(u) if mine else None
        if joined:
            mine[-1] = joined
        else:
            mine.append(u)
    return mine
