"""A fake worker group for the real scheduler core: no model, no device, every rank's state checked
against each plan and adapter command. The scheduler tests, the compatibility-log recorder and the
adapter-policy simulator (scripts/) build on it.

- slots.py: each rank's slot table, CPU tier and pending loads (PendingLoad, FakeSlots, LoadPolicy)
- rank.py: one rank's requests, tokens and KV (FakeWorker); reports.py: its prompt logprobs
- group.py: the ranks together (FakeGroup), also a `Runner` for the in-process engine
- driver.py: the core and a group, one input at a time (Driver); loads.py: its load deliveries
- workload.py: seeded random workloads over a Driver
"""
