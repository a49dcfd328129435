"""Fixtures shared by the HTTP suites."""

from __future__ import annotations

import pytest

SCHEDULING_ARGS = {"one-step": [], "async": ["--async-scheduling"]}


@pytest.fixture(scope="module", params=sorted(SCHEDULING_ARGS, reverse=True))
def scheduling(request) -> str:
    """A module's server runs once per scheduling loop: the one-step loop, then async scheduling."""
    return request.param
