"""What a stage's key is made of, its hash, and the reasons two keys differ (for `moeflow why`).

A key has five parts, each recorded in the artifact's lineage so a later run can say what changed:
`config` (the config slice the body receives, operational fields left out), `code` (normalised hashes
of the moeflow modules the body reaches), `libraries` (versions of the distributions that shape the
output), `fetched` (identities of the files read from outside the store: registry packages by version,
sha256 and the digest of their extracted tree, local files by path, size and the xxh3 of their bytes) and
`inputs` (the content hashes of the input artifacts).
"""

from __future__ import annotations

import json
from typing import Any

import xxhash
from pydantic import BaseModel


def _is_operational(model: BaseModel, name: str) -> bool:
    extra = type(model).model_fields[name].json_schema_extra
    return isinstance(extra, dict) and bool(extra.get("operational"))


def _walk(value: Any, keep_operational: bool, path: str = "") -> Any:
    """`value` as JSON data: with `keep_operational` false, operational fields are dropped; with it
    true, only the operational fields are kept, as {dotted path: value}."""
    if isinstance(value, BaseModel):
        out = {}
        for name in type(value).model_fields:
            field = getattr(value, name)
            if _is_operational(value, name):
                if keep_operational:
                    out[f"{path}{name}"] = _plain(field)
                continue
            sub = _walk(field, keep_operational, f"{path}{name}.")
            if keep_operational:
                out.update(sub or {})
            else:
                out[name] = sub
        return out
    if isinstance(value, dict):
        items = [(str(k), _walk(v, keep_operational, f"{path}{k}.")) for k, v in value.items()]
    elif isinstance(value, (list, tuple)):
        items = [(str(i), _walk(v, keep_operational, f"{path}{i}.")) for i, v in enumerate(value)]
    else:
        return {} if keep_operational else _plain(value)
    if keep_operational:
        return {k: v for _, sub in items for k, v in (sub or {}).items()}
    return dict(items) if isinstance(value, dict) else [v for _, v in items]


def _plain(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    return json.loads(json.dumps(value, default=lambda v: getattr(v, "value", str(v))))


def keyed(slice_: Any) -> Any:
    """The part of a config slice that is in the key: everything but operational fields, as JSON data."""
    return json.loads(canonical(_walk(slice_, False)))


def operational(slice_: Any) -> dict[str, Any]:
    """The operational fields of a config slice: {dotted path: value}, handed to the body, never keyed."""
    return _walk(slice_, True)


def canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def digest(stage: str, parts: dict) -> str:
    """The key: a hash of the stage name and its five parts."""
    return xxhash.xxh3_64_hexdigest(canonical({"stage": stage, **parts}).encode())


def _flat(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict) and obj:
        return {k: v for key, sub in obj.items() for k, v in _flat(sub, f"{prefix}{key}.").items()}
    if isinstance(obj, list) and obj:
        return {k: v for i, sub in enumerate(obj) for k, v in _flat(sub, f"{prefix}{i}.").items()}
    return {prefix[:-1]: obj}


def _short(value: Any, width: int = 60) -> str:
    text = "(absent)" if value is _MISSING else json.dumps(value, default=str)
    return text if len(text) <= width else text[: width - 3] + "..."


_MISSING = object()


def _by_path(fetched: dict | None) -> dict:
    """Fetched identities with each local source's files keyed by path, so a changed file is named (and an
    added one shifts no other) rather than numbered."""
    out = {}
    for name, ident in (fetched or {}).items():
        if isinstance(ident, list):  # a local source's files; a dataset's fingerprint keeps its place
            ident = {f.get("path", str(i)): {k: v for k, v in f.items() if k != "path"} for i, f in enumerate(ident)}
        out[name] = ident
    return out


def explain(old: dict, new: dict, section: str = "") -> list[str]:
    """Why key parts `new` differ from `old`: one line per config field, module, library, fetched file
    or input that changed; a config field by its path under `section` when the slice is one."""
    lines: list[str] = []
    a, b = _flat(old.get("config")), _flat(new.get("config"))
    under = f"{section}." if section else ""
    lines += [f"config {under}{k}: {_short(a.get(k, _MISSING))} -> {_short(b.get(k, _MISSING))}"
              for k in sorted(set(a) | set(b)) if a.get(k, _MISSING) != b.get(k, _MISSING)]
    x, y = _flat(_by_path(old.get("fetched"))), _flat(_by_path(new.get("fetched")))
    lines += [f"fetched {k}: {_short(x.get(k, _MISSING))} -> {_short(y.get(k, _MISSING))}"
              for k in sorted(set(x) | set(y)) if x.get(k, _MISSING) != y.get(k, _MISSING)]
    for part, what in (("code", "code of module"), ("libraries", "library"), ("inputs", "input")):
        x, y = old.get(part) or {}, new.get(part) or {}
        for k in sorted(set(x) | set(y)):
            if x.get(k, _MISSING) == y.get(k, _MISSING):
                continue
            if part == "code":
                change = "added" if k not in x else "removed" if k not in y else "changed"
                lines.append(f"{what} {k} {change}")
            elif part == "inputs" and (y.get(k) is None):
                lines.append(f"input {k} is rebuilt first (this stage is reused if its content is unchanged)")
            else:
                lines.append(f"{what} {k}: {_short(x.get(k, _MISSING))} -> {_short(y.get(k, _MISSING))}")
    return lines
