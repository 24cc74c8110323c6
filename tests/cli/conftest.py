import pytest

from offload_core.device.plugins import ENV_BACKEND


@pytest.fixture
def no_env_override(monkeypatch):
    """No backend chosen by the environment: the tests say which one they mean."""
    monkeypatch.delenv(ENV_BACKEND, raising=False)
