"""Adapter benchmarks: loading, churn under traffic, PEFT comparison, slot-policy simulation."""
