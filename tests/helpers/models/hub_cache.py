"""Lay model folders out as a real Hugging Face hub cache (what `snapshot_download` leaves behind), so hub ids
resolve offline: models--ORG--NAME/blobs/<sha256>, snapshots/<commit>/<file> -> ../../blobs/<sha256>, and
refs/<revision> holding the commit hash."""
from __future__ import annotations

import hashlib
import os
import shutil

HF_ENV = ("HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
          "HF_TOKEN", "XDG_CACHE_HOME")


def commit_hash(label: str) -> str:
    """A stable 40-hex 'commit' for a snapshot label."""
    return hashlib.sha1(label.encode()).hexdigest()


def add_snapshot(cache_dir: str, repo_id: str, folder: str, revision: str = "main") -> str:
    """Copy `folder`'s files into the cache as the snapshot `revision` of `repo_id`; returns the commit hash.
    Files shared with other snapshots share their blob, as in a real cache."""
    repo = os.path.join(cache_dir, "models--" + repo_id.replace("/", "--"))
    commit = commit_hash(f"{repo_id}@{revision}")
    snap = os.path.join(repo, "snapshots", commit)
    os.makedirs(os.path.join(repo, "blobs"), exist_ok=True)
    os.makedirs(snap, exist_ok=True)
    for name in sorted(os.listdir(folder)):
        src = os.path.join(folder, name)
        if not os.path.isfile(src):
            continue
        with open(src, "rb") as f:
            sha = hashlib.sha256(f.read()).hexdigest()
        blob = os.path.join(repo, "blobs", sha)
        if not os.path.exists(blob):
            shutil.copyfile(src, blob)
        os.symlink(os.path.join("..", "..", "blobs", sha), os.path.join(snap, name))
    os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
    with open(os.path.join(repo, "refs", revision), "w") as f:
        f.write(commit)           # no newline: huggingface_hub reads the file as is
    return commit


def offline_env(**hf: str) -> dict[str, str]:
    """This process's environment without any HF_* setting of the machine, plus `hf` and HF_HUB_OFFLINE=1."""
    env = {k: v for k, v in os.environ.items() if k not in HF_ENV}
    return {**env, "HF_HUB_OFFLINE": "1", **hf}
