"""Where a model or tokenizer comes from: a local directory, or a Hugging Face id ORG/NAME resolved
through the Hugging Face cache (downloading what is missing unless HF_HUB_OFFLINE=1). Only
configs, tokenizer files and safetensors weights are fetched: nothing pickled is ever downloaded
or loaded."""

from __future__ import annotations

import glob
import os
import re

from ledgerserve.shared import env
from ledgerserve.shared.flag_values import revision_name

ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}$")


class ModelSourceError(ValueError):
    """A model or tokenizer could not be found or is refused; the message says what to do."""


def resolve(spec: str, revision: str = "", download_dir: str = "", what: str = "model") -> str:
    """The directory holding `spec`: `spec` itself if it is a directory, else the snapshot of the
    Hugging Face id `spec` at `revision` (branch, tag or commit; default main) in `download_dir`,
    else the user's Hugging Face cache."""
    if os.path.isdir(spec):
        return os.path.abspath(spec)
    if not _REPO_ID.match(spec) or ".." in spec:
        raise ModelSourceError(f"{what} {spec!r} is neither a local directory nor a Hugging Face id ORG/NAME")
    if revision:
        revision_name(revision)  # never a path: huggingface_hub reads refs/REVISION in the cache
    cache_dir = os.path.abspath(os.path.expanduser(download_dir)) if download_dir else env.hf_hub_cache()
    return _snapshot(spec, revision, cache_dir, what)


def require_safetensors(model_dir: str, spec: str, revision: str = "") -> None:
    """Refuse a checkpoint without *.safetensors weights, naming the weight files it has instead."""
    if glob.glob(os.path.join(model_dir, "*.safetensors")):
        return
    others = sorted(name for name in os.listdir(model_dir) if name.endswith(PICKLE_SUFFIXES))
    if not others and not env.hf_hub_offline() and not os.path.isdir(spec):
        others = _remote_pickle_files(spec, revision)
    has = f"this checkpoint has {', '.join(others)}" if others else "this checkpoint has no *.safetensors files"
    raise ModelSourceError(
        f"only safetensors weights are loaded; {has} ({spec}): nothing is ever unpickled. "
        "Use a checkpoint with *.safetensors weights (or --load-format dummy for random weights)"
    )


def _snapshot(repo_id: str, revision: str, cache_dir: str, what: str) -> str:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    offline = env.hf_hub_offline()
    at = f"{what} {repo_id!r} (revision {revision or 'main'})"
    fetch = f"`hf download {repo_id}{f' --revision {revision}' if revision else ''}`"
    try:
        return snapshot_download(
            repo_id,
            revision=revision or None,
            cache_dir=cache_dir,
            allow_patterns=ALLOW_PATTERNS,
            local_files_only=offline,
        )
    except LocalEntryNotFoundError:
        if offline:
            why, todo = "HF_HUB_OFFLINE=1 is set", f"run without HF_HUB_OFFLINE or {fetch}"
        else:
            why, todo = "the Hugging Face Hub could not be reached", f"check the network, or run {fetch} where it is"
        raise ModelSourceError(
            f"{at} is not in the cache at {cache_dir} and {why}; {todo} "
            "(with --download-dir DIR if you keep models elsewhere), or give a local directory"
        ) from None
    except GatedRepoError:
        raise ModelSourceError(f"{at} is gated: accept its terms on the Hub and log in (`hf auth login`)") from None
    except RevisionNotFoundError:
        raise ModelSourceError(f"{at}: no such revision (a branch, tag or commit of {repo_id})") from None
    except RepositoryNotFoundError:
        raise ModelSourceError(
            f"{at} is not on the Hugging Face Hub (or is private: log in with `hf auth login`); "
            f"cache searched: {cache_dir}"
        ) from None
    except (HfHubHTTPError, OSError) as e:
        raise ModelSourceError(f"{at} could not be downloaded into {cache_dir}: {e}") from None


def _remote_pickle_files(repo_id: str, revision: str) -> list[str]:
    """The pickled weight files the Hub lists for `repo_id` ([] when it cannot be asked)."""
    from huggingface_hub import HfApi

    try:
        files = HfApi().list_repo_files(repo_id, revision=revision or None)
    except Exception:  # only used to word the refusal; the refusal stands either way
        return []
    return sorted(name for name in files if name.endswith(PICKLE_SUFFIXES))
