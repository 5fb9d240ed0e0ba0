"""The stage contract: what a stage declares (its name, inputs' config slice, body or phases, libraries, fetched
files), as plain values its own package holds; `tasks/` runs any of them the same way.

It sits on the ground floor because every stage package declares its stages with it and `tasks/` runs them.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RunConfig = Any  # `moeflow.configs.RunConfig`: the ground floor names no class above it


class Lazy:
    """A stage body named `module:function`, imported when first called: the training, evaluation and card
    bodies import torch and matplotlib, which a data stage's worker process should not hold (~250 MB)."""

    def __init__(self, target: str):
        self.__module__, self.name = target.split(":")

    def __call__(self, *args, **kwargs):
        return getattr(importlib.import_module(self.__module__), self.name)(*args, **kwargs)


@dataclass(frozen=True)
class Phase:
    """One fan-out step of a sharded stage: `parts(cfg, inputs)` tasks, each its own artifact
    `<stage>.<name>`.

    `body(slice, inputs, prior, out, part=(i, n))`; `prior` maps each earlier phase's name to its parts'
    folders, in part order."""

    name: str
    body: Callable[..., dict]
    parts: Callable[[RunConfig, dict], int]  # (config, the stage's input manifests) -> how many
    # the stage's first phase, of one part, fixing what it reads: its key holds the fetched files' identities and
    # its artifact lists the files, so the later phases and the join take both from it (their keys hold its
    # content hash and its key's `fetched`) instead of listing the sources again, each at another moment
    plans: bool = False


@dataclass(frozen=True)
class Stage:
    name: str
    config: Callable[[RunConfig], Any]  # the slice the body receives: its non-operational part is the key
    # (slice, inputs, out[, work]): writes the artifact, returns stats; None: the stage is its phases
    body: Callable[..., dict] | None
    # distributions whose versions shape the output (or a function of the slice naming them)
    libraries: tuple[str, ...] | Callable[[Any], tuple[str, ...]] = ()
    fetched: Callable[[Any], dict] | None = None  # (slice) -> identities of the files read outside the store
    resumable: bool = False
    # the input all of which the stage reads ("docs": a documents table; "shards": a token store; "mix": its
    # held-out rows), and what the runner checks: each (the stage's stat, that input's stat, what they count),
    # equal (None: it read none, by its config; a mapping: by key, as a domain's count)
    reads: str | None = None
    counts: tuple[tuple[str, str, str], ...] = (("documents_in", "documents_out", "documents"),)
    # a sharded stage: its phases run in order, then `merge(slice, prior, out)` joins them into the artifact,
    # whose key leaves the part counts out (the output is the same for any); a stage with a body runs
    # that instead when every phase has one part. Phase bodies live in the body's module.
    phases: tuple[Phase, ...] = ()
    merge: Callable[[Any, dict[str, list[Path]], Path], dict] | None = None
    # the config section the slice's fields belong to (`filter`, `quality`), where the slice is one section or
    # part of one: `moeflow why` names a changed field by its full path (`quality.keep.top_fraction`)
    section: str = ""

    @property
    def module(self) -> str:
        return (self.body or self.phases[0].body).__module__

    def sharded(self, cfg: RunConfig, inputs: dict) -> bool:
        return bool(self.phases) and (self.body is None or any(p.parts(cfg, inputs) > 1 for p in self.phases))

    def fanout(self, cfg: RunConfig, inputs: dict) -> dict[str, int]:
        """Every phase's part count."""
        return {p.name: p.parts(cfg, inputs) for p in self.phases}




def record_shards(cfg: RunConfig, inputs: dict) -> int:
    """A record-sharded phase's part count: `execution.shards` contiguous shards of the input."""
    return cfg.execution.shards
