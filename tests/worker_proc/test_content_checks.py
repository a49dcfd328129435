"""What a worker checks on every read of an adapter version from disk: the files hash to the SHA-256
the version was registered with (all of it, over exactly the bytes it parses and keeps), and the
values it keeps are finite once cast to the model's dtype, whatever the digest says. A file swapped
after registration (NaN weights of the same size, bytes forged to keep the old xxh64, a header
swapped back between its parse and its hash) fails that version alone, with a clear error: a
request on it fails, and every other request is served as before."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
import xxhash
from safetensors.torch import load_file

from ledgerserve.shared import adapter_format
from ledgerserve.shared.adapter_types import CONFIG_FILE, WEIGHTS_FILE
from ledgerserve.shared.events import AdapterLoadCompleted, AdapterLoadFailed, AdapterSlotAssigned
from ledgerserve.shared.safetensors_header import read_header
from ledgerserve.worker_proc.lora.manager import LoraManager
from ledgerserve.worker_proc.models.config import load_model_config
from ledgerserve.worker_proc.models.loader import build_model
from ledgerserve.worker_proc.parallel import TpGroup
from ledgerserve.worker_proc.runner import ModelRunner
from tests.reference import assert_greedy_matches
from tests.shared.hostile_adapters import edit_config, poison_weights
from tests.shared.xxh64_forge import forge
from tests.worker_proc.fake_scheduler import FakeScheduler, run_to_completion
from tests.worker_proc.hostile_runs import files_sha256
from tests.worker_proc.lora_setup import BLOCK_SIZE, GREEDY, NUM_BLOCKS, LoraSetup, lora_config
from tests.worker_proc.test_shard_image import _base


def _nan_tensor(path: Path) -> None:
    """The first lora_A rewritten in place as NaN: the file keeps its size and header."""
    data = bytearray((path / WEIGHTS_FILE).read_bytes())
    start, stop = _first_a(data)
    data[start:stop] = struct.pack("<f", float("nan")) * ((stop - start) // 4)
    (path / WEIGHTS_FILE).write_bytes(bytes(data))


def _xxh64_collision(path: Path) -> None:
    """Two stripes of the first lora_A forged (NaN, then what restores xxh64's state): the config
    and weights bytes hash as before under the old xxh64 digest."""
    config, data = (path / CONFIG_FILE).read_bytes(), (path / WEIGHTS_FILE).read_bytes()
    start, _ = _first_a(data)
    at = -(-(len(config) + start) // 32) * 32  # the first whole stripe of the tensor in config + weights
    forged = forge(config + data, at, struct.pack("<f", float("nan")) * 8)[len(config) :]
    assert xxhash.xxh64(config + forged).intdigest() == xxhash.xxh64(config + data).intdigest() and forged != data
    (path / WEIGHTS_FILE).write_bytes(forged)


def _first_a(data: bytes | bytearray) -> tuple[int, int]:
    """File offsets [start, stop) of the first lora_A's values (F32)."""
    (header_len,) = struct.unpack_from("<Q", data)
    header = json.loads(data[8 : 8 + header_len])
    key = sorted(k for k in header if "lora_A" in k)[0]
    start, stop = header[key]["data_offsets"]
    return 8 + header_len + start, 8 + header_len + stop


SWAPS = {"nan-same-size": _nan_tensor, "xxh64-collision": _xxh64_collision}


@pytest.mark.parametrize("swap", sorted(SWAPS))
def test_a_file_swapped_after_registration_fails_that_version_alone(
    lora_setup: LoraSetup, tmp_path: Path, swap: str
) -> None:
    path = Path(shutil.copytree(lora_setup.adapter_dirs["mlp"], tmp_path / f"swapped-{swap}"))
    registered = files_sha256(str(path))
    size = (path / WEIGHTS_FILE).stat().st_size
    SWAPS[swap](path)
    assert (path / WEIGHTS_FILE).stat().st_size == size
    runner = ModelRunner(lora_config(lora_setup.base_dir))
    failed = runner.adapters.load(AdapterSlotAssigned(0, 1, str(path), content_sha256=registered))
    assert isinstance(failed, AdapterLoadFailed) and failed.slot == 0, failed
    assert failed.message.startswith(f"adapter swapped-{swap} changed on disk since it was registered (content SHA-256")
    assert 0 not in runner.lora.slots and runner.lora.pool.num_used_pages == 0
    attn = lora_setup.adapter_dirs["attn"]
    assert isinstance(
        runner.adapters.load(AdapterSlotAssigned(1, 2, attn, content_sha256=files_sha256(attn))), AdapterLoadCompleted
    )
    _serves_only_the_others(runner, lora_setup)


def _serves_only_the_others(runner: ModelRunner, setup: LoraSetup) -> None:
    """A request on slot 0 fails alone; base and slot 1 ("attn") requests in the same steps match PEFT."""
    sched = FakeScheduler(BLOCK_SIZE, NUM_BLOCKS)
    sched.add("on-failed", setup.prompts["mlp"], GREEDY, chunk=8, lora_slot=0)
    completed, _ = runner.execute(sched.plan())
    assert [f.req_id for f in completed.failed] == ["on-failed"] and "slot 0" in completed.failed[0].message
    sched.running.pop("on-failed")
    sched.add("base", setup.prompts["base"], GREEDY, chunk=8)
    sched.add("attn", setup.prompts["attn"], GREEDY, chunk=8, lora_slot=1)
    done = run_to_completion(runner, sched)
    assert_greedy_matches({n: r.outputs for n, r in done.items()}, {n: setup.refs[n] for n in ("base", "attn")})


def test_the_header_hashed_is_the_header_parsed(
    lora_setup: LoraSetup, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A header that swaps two modules' tensors is in the file while the worker parses it, and the
    registered file is back by the time the bytes are hashed: the hash is of what was parsed, so
    the read fails instead of loading the two tensors swapped."""
    path = Path(shutil.copytree(lora_setup.adapter_dirs["mlp"], tmp_path / "header-swap"))
    registered, original = files_sha256(str(path)), (path / WEIGHTS_FILE).read_bytes()
    (path / WEIGHTS_FILE).write_bytes(_swap_offsets(original, "layers.0.mlp.gate_proj", "layers.0.mlp.up_proj"))
    real_read_header = adapter_format.read_header

    def parse_then_restore(fd: int, file_size: int, max_tensors: int):
        header = real_read_header(fd, file_size, max_tensors)
        (path / WEIGHTS_FILE).write_bytes(original)  # the same inode: the open file reads these bytes now
        return header

    monkeypatch.setattr(adapter_format, "read_header", parse_then_restore)
    runner = ModelRunner(lora_config(lora_setup.base_dir))
    failed = runner.adapters.load(AdapterSlotAssigned(0, 1, str(path), content_sha256=registered))
    assert isinstance(failed, AdapterLoadFailed) and "changed on disk since it was registered" in failed.message


def _swap_offsets(data: bytes, first: str, second: str) -> bytes:
    """The file with the data_offsets of the two modules' lora_A swapped, its header as long as before."""
    (header_len,) = struct.unpack_from("<Q", data)
    header = json.loads(data[8 : 8 + header_len])
    a, b = (f"base_model.model.model.{m}.lora_A.weight" for m in (first, second))
    assert header[a]["shape"] == header[b]["shape"]
    header[a]["data_offsets"], header[b]["data_offsets"] = header[b]["data_offsets"], header[a]["data_offsets"]
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= header_len
    return data[:8] + text.ljust(header_len) + data[8 + header_len :]


UNFIT = {  # registered with their own files' SHA-256, as if their validation had been bypassed
    "overflows-in-bfloat16": (poison_weights(3.4e38, torch.float32), "once cast to the model's dtype (bfloat16)"),
    "nan": (poison_weights(float("nan"), torch.float32), "holds NaN or infinite values"),
    "infinite-scaling": (lambda p, _: edit_config(p, lora_alpha=1e40), "past the float32 range"),
}


@pytest.mark.parametrize("name", sorted(UNFIT))
def test_values_are_checked_on_every_read_whatever_the_digest(lora_setup: LoraSetup, tmp_path: Path, name: str) -> None:
    """A bfloat16 worker's slots hold what it cast: an adapter unfit there fails its load even though
    its files hash to the registered SHA-256, and leaves nothing in the CPU tier or the slot."""
    build, fragment = UNFIT[name]
    path = Path(shutil.copytree(lora_setup.adapter_dirs["mlp"], tmp_path / name))
    build(path, tmp_path)
    base_dir, cpu = lora_setup.base_dir, torch.device("cpu")
    model = build_model(load_model_config(base_dir), base_dir, "dummy", torch.bfloat16, cpu, 0, 0, TpGroup())
    config = lora_config(base_dir, lora_overlap_loading=False)
    manager = LoraManager(model, config, _base(base_dir), torch.bfloat16, cpu)
    [reply] = manager.load_now(0, 1, str(path), files_sha256(str(path)), 0.0)
    assert isinstance(reply, AdapterLoadFailed) and fragment in reply.message, reply
    assert not manager.slots and not manager.loader.cpu.entries and manager.pool.num_used_pages == 0
    fine = lora_setup.adapter_dirs["attn"]
    [reply] = manager.load_now(1, 2, fine, files_sha256(fine), 0.0)
    assert isinstance(reply, AdapterLoadCompleted)
    manager.close()


def test_a_header_read_once_still_parses_as_safetensors_does(lora_setup: LoraSetup) -> None:
    """The bytes kept for the digest are the file's own first bytes."""
    weights = Path(lora_setup.adapter_dirs["mlp"]) / WEIGHTS_FILE
    data = weights.read_bytes()
    with open(weights, "rb") as f:
        header = read_header(f.fileno(), len(data), 64)
    assert header.raw == data[: header.data_offset] and set(header.tensors) == set(load_file(str(weights)))
