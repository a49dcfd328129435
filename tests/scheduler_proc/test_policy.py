"""The core's policy by log schema (scheduler_proc/core/policy.py): today's schema gets today's
engine, each older schema differs from the next by the one behaviour its migration names, and a
core config cannot overlap adapter loads under a policy whose engine did not."""

from __future__ import annotations

import dataclasses

import pytest

from ledgerserve.scheduler_proc.core import CoreConfig
from ledgerserve.scheduler_proc.core.policy import Policy
from ledgerserve.shared.eventlog import SCHEMA_VERSION
from tests.scheduler_proc.logtools import ENGINE

MIGRATIONS = {  # the schema whose engine first behaved as today -> (behaviour, its value before)
    2: ("keep_dropped_namespaces", True),
    3: ("overlap_loading", False),
    4: ("targeted_drain", False),
    5: ("op_reply_registry", True),
    6: ("digest_load_reports", True),
}


def test_todays_schema_is_todays_engine():
    assert Policy.for_schema(SCHEMA_VERSION) == Policy.current() == CoreConfig.from_engine(ENGINE).policy


@pytest.mark.parametrize("version", sorted(MIGRATIONS))
def test_each_schema_differs_from_the_one_before_by_its_migration(version):
    name, before = MIGRATIONS[version]
    older, newer = Policy.for_schema(version - 1), Policy.for_schema(version)
    assert getattr(older, name) == before and dataclasses.replace(older, **{name: not before}) == newer


def test_overlapped_loading_needs_a_policy_that_has_it():
    assert ENGINE.lora_overlap_loading
    assert not CoreConfig.from_engine(ENGINE, Policy.for_schema(2)).lora_overlap_loading
    assert CoreConfig.from_engine(ENGINE, Policy.for_schema(3)).lora_overlap_loading
    with pytest.raises(ValueError, match="overlapped loading"):
        dataclasses.replace(CoreConfig.from_engine(ENGINE), policy=Policy.for_schema(2))
