"""`moeflow why`: a dry run of the flow that says, per stage, whether it would be reused or rebuilt, and why.

Nothing is built. Each stage's key is computed as a run would compute it; a stage whose input would be
rebuilt first cannot know that input's content hash yet, so it is reported as `depends` (rebuilt only
if the input's bytes change) along with any change of its own. A rebuild is explained against the
artifact the latest recorded run of the same config used for that stage (else the newest artifact of
that stage in the store): the config fields with old -> new values, the modules whose code changed,
the library versions, the fetched packages or files, the inputs.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from moeflow.configs import RunConfig
from moeflow.core.stage import Stage
from moeflow.flows.pretrain import dag
from moeflow.lineage import keys
from moeflow.store.format import is_remote
from moeflow.store.local import Manifest
from moeflow.store.url import store_for
from moeflow.tasks.pipeline import check_stages
from moeflow.tasks.registry import STAGES
from moeflow.tasks.runner import key_parts
from moeflow.tokenize import tokenizer


class Unknown(Exception):
    """A value the dry run cannot know before building (the vocabulary of a tokenizer being rebuilt)."""


@dataclass
class Plan:
    label: str
    stage: str
    status: str  # reuse | rebuild | depends
    key: str | None = None
    manifest: Manifest | None = None  # the artifact a reuse would return
    against: str | None = None  # the earlier artifact a rebuild is explained against
    reasons: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"label": self.label, "stage": self.stage, "status": self.status, "key": self.key,
                "artifact": self.manifest.path if self.manifest else None, "against": self.against,
                "reasons": self.reasons}


class DryRun:
    """Plays the part of `Pipeline` in the flow's `dag`: computes keys, looks them up, builds nothing."""

    def __init__(self, cfg: RunConfig, rerun: list[str] | tuple[str, ...] = (), until: str | None = None):
        check_stages(rerun, until)
        self.cfg, self.rerun, self.until = cfg, set(rerun), until
        self.store = store_for(cfg.store_url())
        self.last_run = _last_run(self.store, cfg.name)
        self.plans: dict[str, Plan] = {}
        self.done = False
        self.searching = False

    def subflow(self, flow_, *args):
        try:
            return flow_.fn(self, *args)
        except Unknown as e:
            plan = Plan(flow_.name, flow_.name, "rebuild", reasons=[str(e)])
            self.plans[flow_.name] = plan
            return plan

    def searched(self, cfg: RunConfig, search: Plan) -> RunConfig:
        """As a run would choose, when the search is stored; else the declared mix (whose plan then has no key:
        its `search` input is rebuilt first)."""
        if search.manifest is None:
            self.searching = True  # the mix's weights are not known yet: `_explain` says so instead of a diff
            return cfg.model_copy(update={"mix": cfg.mix.tilted(cfg.mix.weights)})
        return cfg.model_copy(update={"mix": cfg.mix.tilted(search.manifest.stats["weights"])})

    def vocab(self, tok: Plan) -> int:
        if tok.manifest is None:
            raise Unknown(
                "the rungs' sizes depend on the tokenizer's vocabulary, and the tokenizer is rebuilt first"
            )
        return tokenizer.load(tok.manifest.dir).get_vocab_size()

    def __call__(
        self, declared: Stage, *, cfg: RunConfig | None = None, label: str | None = None, **inputs: Plan
    ) -> Plan | None:
        if self.done:
            return None
        stage = declared.name
        label = label or stage
        content = {k: p.manifest.content_hash if p.manifest else None for k, p in inputs.items()}
        parts = key_parts(STAGES[stage], cfg or self.cfg, content)
        plan = Plan(label, stage, "rebuild")
        if None not in content.values():
            plan.key = keys.digest(stage, parts)
            plan.manifest = self.store.get(stage, plan.key)
        if plan.manifest is not None and stage not in self.rerun:
            plan.status, plan.reasons = "reuse", ["same key"]
        else:
            plan.manifest = None
            self._explain(plan, parts)
        self.plans[label] = plan
        self.done = stage == self.until
        return plan

    def _explain(self, plan: Plan, parts: dict) -> None:
        if plan.stage in self.rerun:
            plan.reasons.append("asked for with --rerun")
        prev = self._previous(plan)
        if prev is None:
            where = getattr(self.store, "url", self.store.root)
            plan.reasons.append(f"no earlier {plan.stage} artifact in the store {where}")
            return
        plan.against = f"{plan.stage}-{prev['artifact']['hash']}"
        if "key" not in prev:
            plan.reasons.append(f"{plan.against} was built by a moeflow that did not record its key parts")
            return
        reasons = keys.explain(prev["key"], parts, STAGES[plan.stage].section)
        if plan.stage == "mix" and self.searching:
            reasons = [r for r in reasons if not re.match(r"config (mix\.)?(phases\.\d+\.)?weights\.", r)]
            reasons.append("config weights: chosen by mix_search, which is rebuilt first")
        plan.reasons += reasons
        own = [r for r in plan.reasons if not r.startswith("input ") or "->" in r]
        if not own and plan.key is None:
            plan.status = "depends"
        if not plan.reasons:
            plan.reasons.append(f"same key parts as {plan.against}, which is no longer in the store")

    def _previous(self, plan: Plan) -> dict | None:
        """The lineage of the artifact to explain a rebuild against."""
        used = self.last_run.get(plan.label)
        if used and is_remote(used):  # <url>/<stage>/<stage>-<hash>/data-<id>
            manifest = self.store.get(plan.stage, used.rsplit("/", 2)[1][len(plan.stage) + 1:])
            if manifest is not None:
                return manifest.lineage()
        elif used and (Path(used) / "lineage.json").exists():
            return json.loads((Path(used) / "lineage.json").read_text())
        return self.store.newest(plan.stage)


def _last_run(store, config: str) -> dict[str, str]:
    """label -> artifact path of the latest recorded run of `config` in this store."""
    for summary in reversed(store.runs()):
        if summary.get("config") == config:
            return {label: s["artifact"] for label, s in summary["stages"].items()}
    return {}


def why(cfg: RunConfig, stage: str | None = None, rerun: tuple[str, ...] = ()) -> list[Plan]:
    """Plan the flow for `cfg` without building anything; with `stage`, up to and including it."""
    run = DryRun(cfg, rerun=rerun, until=stage)
    dag(run, cfg)
    return list(run.plans.values())


def render(plans: list[Plan]) -> str:
    lines = []
    for p in plans:
        head = f"{p.label:14s} {p.status:8s}"
        target = p.manifest.name if p.manifest else (f"(against {p.against})" if p.against else "")
        lines.append(f"{head} {target}".rstrip())
        if p.status != "reuse":
            lines += [f"{'':24s}{r}" for r in p.reasons]
    return "\n".join(lines)
