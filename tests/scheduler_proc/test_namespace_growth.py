"""The per-step state stays O(live), not O(history): an unloaded adapter version's prefix
namespace leaves the state (and so every StateDigest's input) once its version is dropped
and its last block is gone; while a request still holds it, it stays covered."""

import os

from ledgerserve.scheduler_proc.core import digest
from ledgerserve.scheduler_proc.core.policy import Policy
from ledgerserve.scheduler_proc.replay.verify import core_config, replay
from ledgerserve.shared import events as ev
from ledgerserve.shared.config import EngineConfig
from ledgerserve.shared.eventlog import EventLogWriter, RunScanner
from tests.scheduler_proc.driver import Driver

PROMPT = list(range(300, 310))  # 10 tokens: two full blocks of 4, cached at prefill


def _lora_driver(policy: Policy | None = None) -> Driver:
    return Driver(num_kv_blocks=16, enable_lora=True, max_loras=2, max_cpu_loras=2, policy=policy)


def _encoded_namespaces(d: Driver) -> int:
    """Namespaces the next StateDigest encodes: those holding blocks, and the evicted ones."""
    cache_rows = d.core.state_rows()[-1]
    return len(cache_rows[0]) + len(cache_rows[3])


def _digest_input_bytes(d: Driver) -> int:
    return len(digest.encode_rows(d.core.state_rows()))


def _load_use_unload(d: Driver, i: int) -> None:
    """One adapter version's life. Every 100th one caches blocks and is unloaded while its
    request runs: a deferred eviction, whose namespace must stay barred and covered until
    the request ends."""
    name = f"adapter-{i % 13}"
    version_id = d.load(name).version_id
    if i % 100:
        d.unload(name)
        return
    d.arrive(f"r{i}", PROMPT, lora=name, max_tokens=3)
    d.complete()  # the prompt is computed: its two blocks are cached in the version's namespace
    d.unload(name)
    assert d.of_type(ev.NamespaceEvicted)[-1] == ev.NamespaceEvicted(version_id, 0, 2)
    rows = d.core.state_rows()[-1]
    assert [version_id, 2] in rows[0] and version_id in rows[3]  # live: still in the digest
    d.run()


def test_ten_thousand_unloads_leave_the_digest_input_flat():
    d = _lora_driver()
    num_namespaces, sizes = [], []
    for i in range(10_000):
        _load_use_unload(d, i)
        if i % 1000 == 999:
            num_namespaces.append(_encoded_namespaces(d))
            sizes.append(_digest_input_bytes(d))
    assert d.core.adapters._num_versions == 10_000 and len(d.of_type(ev.NamespaceEvicted)) == 10_000
    assert num_namespaces == [0] * 10
    assert d.core.scheduler.block_manager.cache.evicted_namespaces == {}
    assert max(sizes) - min(sizes) <= 8, sizes  # only the step number's and ids' widths vary
    d.check_idle()


def test_schema_1_core_keeps_every_dropped_namespace():
    """The contrast that shows what the test above measures: the old behaviour, still used
    to replay schema 1 logs, grows by one encoded namespace per unload."""
    d = _lora_driver(Policy.for_schema(1))  # the schema 1 behaviour, kept only to replay old logs
    for i in range(300):
        _load_use_unload(d, i)
    assert _encoded_namespaces(d) == 300
    fresh = _lora_driver()
    for i in range(300):
        _load_use_unload(fresh, i)
    assert _digest_input_bytes(d) > _digest_input_bytes(fresh) + 300


def test_reload_in_place_forgets_the_old_version_after_its_last_request():
    d = _lora_driver()
    d.load("x")
    d.arrive("old", PROMPT, lora="x", max_tokens=3)
    d.complete()
    reply = d.load("x", inplace=True)  # version 2; version 1 is deferred, its namespace barred
    assert reply.code == 200 and d.core.state_rows()[-1][3] == [1]
    d.arrive("new", PROMPT, lora="x", max_tokens=1)
    d.run()
    assert d.core.state_rows()[-1][3] == [] and d.blocks.namespace_block_counts() == [(2, 2)]
    assert all(x.namespace == 1 for x in d.of_type(ev.PrefixCached) if x.req_id == "old")
    d.check_idle()


def test_replay_takes_the_namespace_rule_from_the_log_schema(tmp_path):
    """Schema 1 logs were written by a core that kept every dropped namespace, and their
    digests say so; schema 2 logs by one that forgets them. Both verify."""
    compat = RunScanner(os.path.join(os.path.dirname(__file__), "..", "data", "logs", "events-000002-lora.log"))
    assert compat.header.schema_version == 1 and core_config(compat).policy.keep_dropped_namespaces
    engine = EngineConfig(
        model_dir="m",
        served_model_name="m",
        max_model_len=256,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        block_size=4,
        enable_lora=True,
        max_loras=2,
        max_cpu_loras=2,
        lora_overlap_loading=False,
    )
    with EventLogWriter(str(tmp_path), engine.to_json(), run_id="new") as writer:
        d = Driver(num_kv_blocks=16, enable_lora=True, max_loras=2, max_cpu_loras=2, log=writer)
        for i in range(201):
            _load_use_unload(d, i)
        d.arrive("last", PROMPT, max_tokens=2)  # steps after the namespaces were forgotten
        d.run()
    scanner = RunScanner(writer.path)
    assert scanner.header.schema_version >= 2 and not core_config(scanner).policy.keep_dropped_namespaces
    result = replay(writer.path)
    assert result.ok and result.num_decisions > 0
    assert result.core.scheduler.block_manager.cache.evicted_namespaces == {}
