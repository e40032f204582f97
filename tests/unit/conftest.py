"""Fixtures shared by the unit tests."""

import pytest
import ray


@pytest.fixture
def forbid_ray_init(monkeypatch):
    """Records any ``ray.init`` call (the list stays empty if Ray is never started); robust to a
    Ray cluster that other tests of the session left running."""
    calls = []
    monkeypatch.setattr(ray, "init", lambda *a, **k: calls.append((a, k)))
    return calls
