"""`moeflow publish`: an export's folder copied to a local folder, or uploaded to a Hugging Face Hub repository."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from tqdm import tqdm

SKIPPED = ("manifest.json",)  # the store's commit marker: meaningless outside it
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def export_dir(artifact: Path) -> Path:
    """The export folder `artifact` names: an export artifact, or a card artifact whose input is one."""
    artifact = Path(artifact)
    record = artifact / "lineage.json"
    if not record.exists():
        raise ValueError(f"{artifact} is not a moeflow artifact (no lineage.json); give an export or card artifact "
                         "folder (`moeflow ls export` lists them)")
    rec = json.loads(record.read_text())
    if rec["stage"] == "export":
        return artifact
    if rec["stage"] == "card" and "export" in rec["inputs"]:
        return artifact.parent.parent / rec["inputs"]["export"]["path"]
    raise ValueError(f"{artifact} is a `{rec['stage']}` artifact: give an export artifact, or a card artifact of "
                     "a run that exported (the config's `export:` section was not null)")


def files(folder: Path) -> list[tuple[str, int]]:
    """Every file that goes out (path relative to the folder, bytes), in order."""
    return [(str(p.relative_to(folder)), p.stat().st_size) for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name not in SKIPPED]


def is_repo_id(target: str) -> bool:
    """`owner/name` that names no existing local path: a Hub repository."""
    return bool(REPO_ID.match(target)) and not Path(target).exists() and not target.startswith(".")


def publish(artifact: Path, target: str, dry_run: bool = False, private: bool = False) -> dict:
    """Copy the export into the folder `target` (which must not exist), or upload it to the Hub repository
    `target`; with `dry_run`, only say what would go where."""
    folder = export_dir(artifact)
    listing = files(folder)
    total = sum(n for _, n in listing)
    done = {"source": str(folder), "to": target, "files": listing, "bytes": total, "dry_run": dry_run,
            "kind": "hub" if is_repo_id(target) else "folder"}
    if dry_run:
        return done
    if done["kind"] == "hub":
        _upload(folder, target, private)
        return done
    dest = Path(target).expanduser()
    if dest.exists():
        raise FileExistsError(f"{dest} exists: publish writes a new folder")
    tmp = dest.with_name(f".{dest.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"publish -> {dest}") as bar:
        for rel, size in listing:
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(folder / rel, tmp / rel)
            bar.update(size)
    tmp.rename(dest)  # a folder that exists is complete
    done["to"] = str(dest.resolve())
    return done


def _upload(folder: Path, repo_id: str, private: bool) -> None:
    """Create the model repository if needed and upload the folder in one commit (huggingface_hub shows its
    own progress); credentials as huggingface_hub reads them (HF_TOKEN, `hf auth login`)."""
    from huggingface_hub import HfApi

    api = HfApi()
    api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
    api.upload_folder(repo_id=repo_id, folder_path=str(folder), repo_type="model",
                      ignore_patterns=list(SKIPPED), commit_message="moeflow publish")
