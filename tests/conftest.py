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


@pytest.fixture(scope="session")
def triton_server(tiny_ckpt, tmp_path_factory):
    """A real tritonserver process serving the model repository on the tiny checkpoint (CPU)."""
    from s2tts.server import TritonServer

    server = TritonServer(tiny_ckpt, {"device": "cpu", "dtype": "fp32", "max_batch": "8", "max_seq_len": "4096",
                           "max_new_tokens_limit": "3000", "chunk_frames": "8"},
                          workdir=tmp_path_factory.mktemp("triton"))
    server.start(timeout=300)
    yield server
    server.stop()
