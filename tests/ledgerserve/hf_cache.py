"""A Hugging Face cache written the way huggingface_hub lays it out, for tests that resolve
model ids offline: `models--ORG--NAME/{blobs/<sha256>, snapshots/<commit>/<file> -> blob,
refs/<ref> = <commit>}`."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path


def add_snapshot(cache_dir: Path, repo_id: str, ref: str, files: dict[str, bytes]) -> Path:
    """One commit of `repo_id` holding `files`, named by `ref` (a branch or tag); its snapshot dir."""
    repo = cache_dir / ("models--" + repo_id.replace("/", "--"))
    commit = hashlib.sha1(repo_id.encode() + ref.encode() + b"".join(sorted(files.values()))).hexdigest()
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / name
        link.unlink(missing_ok=True)
        os.symlink(os.path.relpath(blob, snapshot), link)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)  # no newline, as huggingface_hub writes it
    return snapshot


def checkpoint_files(model_dir: str, **config: object) -> dict[str, bytes]:
    """A checkpoint's files read from `model_dir`, `config` merged into its config.json."""
    files = {p.name: p.read_bytes() for p in Path(model_dir).iterdir() if p.is_file()}  # a checkpoint: its top files
    if config:
        files["config.json"] = json.dumps({**json.loads(files["config.json"]), **config}).encode()
    return files


def pickle_only(files: dict[str, bytes]) -> dict[str, bytes]:
    """The same checkpoint with its weights as pytorch_model.bin (the bytes are never read)."""
    kept = {name: data for name, data in files.items() if not name.endswith(".safetensors")}
    return {**kept, "pytorch_model.bin": b"\x80\x04not a real pickle"}
