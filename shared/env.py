"""Every environment variable ledgerserve reads, named and read here and nowhere else.

Values are read at each call (tests set them per case). The test fault switches inject one
fault each into a real process group; nothing sets them outside the tests.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

LOG_LEVEL = "LEDGERSERVE_LOG_LEVEL"  # logging level of every process (default INFO)
API_KEY = "LEDGERSERVE_API_KEY"  # the Bearer key; only the HTTP process gets it
ADMIN_API_KEY = "LEDGERSERVE_ADMIN_API_KEY"  # the Bearer key of the adapter routes; only the HTTP process gets it
LAUNCHER_PID = "LEDGERSERVE_LAUNCHER_PID"  # set by the launcher for each child it starts
PDL = "LEDGERSERVE_PDL"  # "0": no programmatic dependent launch (Hopper kernels)
FUSED_ALL_REDUCE_NORM = "LEDGERSERVE_FUSED_ALL_REDUCE_NORM"  # "0": TP all-reduces before a norm run alone
GEMM_TUNING = "LEDGERSERVE_GEMM_TUNING"  # "0": no start-up GEMM algorithm tuning
FAULT_DIGEST_RANK = "LEDGERSERVE_TEST_FAULT_DIGEST_RANK"  # test: this rank reports a wrong state digest ...
FAULT_DIGEST_STEP = "LEDGERSERVE_TEST_FAULT_DIGEST_STEP"  # ... from this step on (default 1)
FAULT_TOKEN_ID = "LEDGERSERVE_TEST_FAULT_TOKEN_ID"  # test: a step that feeds this token id fails
FAULT_TP_STALL_RANK = "LEDGERSERVE_TEST_FAULT_TP_STALL_RANK"  # test: this rank stalls (alive) before ...
FAULT_TP_STALL_STEP = "LEDGERSERVE_TEST_FAULT_TP_STALL_STEP"  # ... the collectives of this step (default 1)
FAULT_LOG_LOSS_SEQ = "LEDGERSERVE_TEST_FAULT_LOG_LOSS_SEQ"  # test: the scheduler loses its unsynced records ...
# ... and dies at the first group-commit fsync that covers this record (shared/eventlog/group_commit.py)
# Set by the launcher for the workers: gloo and NCCL bind their sockets to loopback only, and the
# symmetric memory of the one-shot all-reduce (worker_proc/parallel.py) maps peers' buffers without
# creating an NVLink multicast object (the one-shot path reads peers directly; it never needs one).
TP_WORKER_ENV = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


# vLLM's switch for /v1/load_lora_adapter and /v1/unload_lora_adapter: "1" or "true" (any case) turns
# run-time adapter updates on, as --lora-allowed-dir does (loads must still lie inside an allowed dir).
ALLOW_RUNTIME_LORA_UPDATING = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_lora_updating() -> bool:
    """VLLM_ALLOW_RUNTIME_LORA_UPDATING as vLLM reads it: true when 1 or true, any case, spaces ignored."""
    return os.environ.get(ALLOW_RUNTIME_LORA_UPDATING, "0").strip().lower() in ("1", "true")


OMP_NUM_THREADS = "OMP_NUM_THREADS"  # given: a CPU rank keeps the threads it names (worker_proc/parallel.py)


def omp_threads_given() -> bool:
    return bool(os.environ.get(OMP_NUM_THREADS))


OMP_WAIT_POLICY = "OMP_WAIT_POLICY"  # given: the user's choice stands (omp_wait_policy leaves it)


@contextmanager
def omp_wait_policy(policy: str) -> Iterator[None]:
    """OMP_WAIT_POLICY=`policy` inside, unless the user set one; removed again after, so that
    children started later do not inherit it. OpenMP reads it once, when torch loads it: only an
    `import torch` inside (the first in the process) takes it."""
    if os.environ.get(OMP_WAIT_POLICY):
        yield
        return
    os.environ[OMP_WAIT_POLICY] = policy
    try:
        yield
    finally:
        os.environ.pop(OMP_WAIT_POLICY, None)


def log_level() -> str:
    return os.environ.get(LOG_LEVEL, "INFO")


def api_key() -> str:
    return os.environ.get(API_KEY, "")


def admin_api_key() -> str:
    return os.environ.get(ADMIN_API_KEY, "")


def without_api_key() -> dict[str, str]:
    """This process's environment without the API keys (what children other than the HTTP one get)."""
    return {k: v for k, v in os.environ.items() if k not in (API_KEY, ADMIN_API_KEY)}


def with_launcher_pid(env: Mapping[str, str] | None, pid: int) -> dict[str, str]:
    return {**(os.environ if env is None else env), LAUNCHER_PID: str(pid)}


def pop_launcher_pid() -> str:
    """The launcher's pid as it was given ('' if none), taken out so this process's children never see it."""
    return os.environ.pop(LAUNCHER_PID, "")


def pdl_wanted() -> bool:
    return os.environ.get(PDL, "1") != "0"


def fused_all_reduce_norm_wanted() -> bool:
    return os.environ.get(FUSED_ALL_REDUCE_NORM, "1") != "0"


def gemm_tuning_wanted() -> bool:
    return os.environ.get(GEMM_TUNING, "1") != "0"


def fault_digest(rank: int, step: int) -> bool:
    """Test switch: whether `rank` reports a wrong digest for `step`."""
    return os.environ.get(FAULT_DIGEST_RANK) == str(rank) and step >= int(os.environ.get(FAULT_DIGEST_STEP, "1"))


def fault_tp_stall(rank: int, step: int) -> bool:
    """Test switch: whether `rank` stalls before the collectives of `step`."""
    return os.environ.get(FAULT_TP_STALL_RANK) == str(rank) and step == int(os.environ.get(FAULT_TP_STALL_STEP, "1"))


def fault_token_id() -> int | None:
    """Test switch: the token id whose step fails, or None."""
    return _int_or_none(FAULT_TOKEN_ID)


def fault_log_loss_seq() -> int | None:
    """Test switch: the record whose group-commit fsync is replaced by a simulated power cut, or None."""
    return _int_or_none(FAULT_LOG_LOSS_SEQ)


def _int_or_none(name: str) -> int | None:
    """Variable `name` as an integer; None when unset or empty."""
    value = os.environ.get(name, "")
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer") from None


HF_HUB_OFFLINE = "HF_HUB_OFFLINE"  # "1": model ids resolve from the Hugging Face cache only
HF_HUB_CACHE = "HF_HUB_CACHE"  # the Hugging Face cache directory ...
HF_HOME = "HF_HOME"  # ... else HF_HOME/hub, else ~/.cache/huggingface/hub


def hf_hub_offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub reads it: 1, true, yes or on (any case)."""
    return os.environ.get(HF_HUB_OFFLINE, "").strip().lower() in ("1", "true", "yes", "on")


def hf_hub_cache() -> str:
    """The Hugging Face cache directory, read at each call (huggingface_hub reads it once, at import)."""
    if os.environ.get(HF_HUB_CACHE):
        return os.path.expanduser(os.environ[HF_HUB_CACHE])
    home = os.environ.get(HF_HOME) or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return os.path.join(os.path.expanduser(home), "hub")
