"""shared/env.py's switches that the product sets or reads as vLLM does."""

from __future__ import annotations

import os
import subprocess
import sys

from ledgerserve.shared import env


def test_omp_wait_policy_is_set_inside_only_and_never_over_the_users(monkeypatch) -> None:
    monkeypatch.delenv(env.OMP_WAIT_POLICY, raising=False)
    with env.omp_wait_policy("PASSIVE"):
        assert os.environ[env.OMP_WAIT_POLICY] == "PASSIVE"
    assert env.OMP_WAIT_POLICY not in os.environ  # children started later do not inherit it
    monkeypatch.setenv(env.OMP_WAIT_POLICY, "ACTIVE")
    with env.omp_wait_policy("PASSIVE"):
        assert os.environ[env.OMP_WAIT_POLICY] == "ACTIVE"
    assert os.environ[env.OMP_WAIT_POLICY] == "ACTIVE"


def test_the_demo_build_loads_torch_with_sleeping_openmp_threads() -> None:
    """In a fresh process (as the launcher builds), torch is loaded while the policy is set."""
    probe = (
        "import os, sys\n"
        "from ledgerserve import demo_model\n"
        "seen = []\n"
        "class Probe:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch': seen.append(os.environ.get('OMP_WAIT_POLICY'))\n"
        "sys.meta_path.insert(0, Probe())\n"
        "demo_model._load_torch()\n"
        "print(seen, os.environ.get('OMP_WAIT_POLICY'))\n"
    )
    clean = {k: v for k, v in os.environ.items() if k != env.OMP_WAIT_POLICY}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=clean, timeout=120)
    assert done.stdout.strip() == "['PASSIVE'] None", done.stderr


def test_runtime_lora_updating_reads_as_vllm(monkeypatch) -> None:
    for value, on in [("1", True), ("true", True), (" True ", True), ("0", False), ("yes", False), ("", False)]:
        monkeypatch.setenv(env.ALLOW_RUNTIME_LORA_UPDATING, value)
        assert env.runtime_lora_updating() is on, value
    monkeypatch.delenv(env.ALLOW_RUNTIME_LORA_UPDATING)
    assert not env.runtime_lora_updating()
