import logging
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """A tiny S2-shaped checkpoint directory (official layout), written once per test session."""
    from s2tts.tiny import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", "tiny", seed=0)


@pytest.fixture
def s2_log(caplog):
    caplog.set_level(logging.INFO, logger="s2tts")
    return caplog
