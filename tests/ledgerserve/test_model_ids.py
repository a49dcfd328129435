"""`ledgerserve serve ORG/NAME` resolves through a Hugging Face cache laid out as huggingface_hub
lays it out, offline (HF_HUB_OFFLINE=1): the snapshot of refs/main, of --revision (a ref or a
commit), from --download-dir; a missing id, revision or safetensors weights stop the start with
one message saying what to do."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ledgerserve.cli import build_parser
from ledgerserve.cli import main as cli_main
from ledgerserve.launcher import resolve_config
from tests.ledgerserve.hf_cache import add_snapshot, checkpoint_files, pickle_only

REPO = "acme/tiny-chat"


@pytest.fixture
def hf_cache(tmp_path: Path, demo_model_dir: str, monkeypatch) -> dict[str, Path]:
    """REPO at main and at tag v2 (another commit), a tokenizer-only repo and a pickle-only
    repo, in the cache HF_HUB_CACHE names; offline."""
    cache = tmp_path / "hub"
    files = checkpoint_files(demo_model_dir)
    snapshots = {
        "main": add_snapshot(cache, REPO, "main", files),
        "v2": add_snapshot(cache, REPO, "v2", checkpoint_files(demo_model_dir, max_position_embeddings=512)),
        "tokenizer": add_snapshot(cache, "acme/tok", "main", {"tokenizer.json": files["tokenizer.json"]}),
        "pickle": add_snapshot(cache, "acme/old-weights", "main", pickle_only(files)),
    }
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return snapshots


def _resolve(tmp_path: Path, *argv: str):
    return resolve_config(build_parser().parse_args(["serve", *argv, "--device", "cpu"]), str(tmp_path))


def test_an_id_resolves_to_its_main_snapshot_and_is_served_under_the_id(hf_cache, tmp_path):
    cfg = _resolve(tmp_path, REPO)
    assert cfg.model_dir == str(hf_cache["main"]) and cfg.served_model_name == REPO
    assert cfg.max_model_len == 2048 and not cfg.is_demo_model and cfg.tokenizer_dir == cfg.model_dir
    assert _resolve(tmp_path, "--model", REPO).model_dir == str(hf_cache["main"])  # vLLM's --model form


def test_revision_picks_the_other_snapshot_by_ref_or_commit(hf_cache, tmp_path):
    tagged = _resolve(tmp_path, REPO, "--revision", "v2")
    assert tagged.model_dir == str(hf_cache["v2"]) and tagged.max_model_len == 512  # its own config.json
    commit = hf_cache["v2"].name
    assert _resolve(tmp_path, REPO, "--revision", commit).model_dir == str(hf_cache["v2"])


def test_download_dir_is_the_cache_searched(hf_cache, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="not in the cache at " + str(tmp_path / "empty")):
        _resolve(tmp_path, REPO)
    cache = hf_cache["main"].parents[2]
    cfg = _resolve(tmp_path, REPO, "--download-dir", str(cache))
    assert cfg.model_dir == str(hf_cache["main"]) and cfg.download_dir == str(cache)


def test_tokenizer_comes_from_another_id(hf_cache, tmp_path):
    cfg = _resolve(tmp_path, REPO, "--tokenizer", "acme/tok")
    assert cfg.tokenizer_dir == str(hf_cache["tokenizer"]) and cfg.model_dir == str(hf_cache["main"])
    with pytest.raises(ValueError, match=r"tokenizer 'acme/tok' \(revision v9\) is not in the cache"):
        _resolve(tmp_path, REPO, "--tokenizer", "acme/tok", "--tokenizer-revision", "v9")


def test_a_missing_id_or_revision_says_what_to_do(hf_cache, tmp_path):
    cache = str(hf_cache["main"].parents[2])
    with pytest.raises(ValueError) as missing:
        _resolve(tmp_path, "acme/absent")
    assert str(missing.value) == (
        f"model 'acme/absent' (revision main) is not in the cache at {cache} and HF_HUB_OFFLINE=1 is set; "
        "run without HF_HUB_OFFLINE or `hf download acme/absent` "
        "(with --download-dir DIR if you keep models elsewhere), or give a local directory"
    )
    with pytest.raises(ValueError, match=r"\(revision nope\).*`hf download acme/tiny-chat --revision nope`"):
        _resolve(tmp_path, REPO, "--revision", "nope")
    with pytest.raises(ValueError, match="neither a local directory nor a Hugging Face id ORG/NAME"):
        _resolve(tmp_path, "./no/such/dir")


def test_a_checkpoint_without_safetensors_is_refused(hf_cache, tmp_path):
    with pytest.raises(ValueError) as refused:
        _resolve(tmp_path, "acme/old-weights")
    assert "only safetensors weights are loaded; this checkpoint has pytorch_model.bin" in str(refused.value)
    assert "nothing is ever unpickled" in str(refused.value)
    assert _resolve(tmp_path, "acme/old-weights", "--load-format", "dummy").load_format == "dummy"  # no weights read


def test_a_failed_resolution_stops_the_start_with_one_message(hf_cache, tmp_path, capsys):
    assert cli_main(["serve", "acme/absent", "--device", "cpu", "--port", "0", "--event-log-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ledgerserve: error: model 'acme/absent' (revision main)")


def test_two_different_models_are_refused(hf_cache, tmp_path):
    with pytest.raises(ValueError, match="two models given"):
        _resolve(tmp_path, REPO, "--model", "acme/other")


def test_a_local_directory_still_wins(demo_model_dir, tmp_path):
    cfg = _resolve(tmp_path, demo_model_dir)
    assert cfg.model_dir == os.path.abspath(demo_model_dir)
    assert cfg.served_model_name == os.path.basename(demo_model_dir)
