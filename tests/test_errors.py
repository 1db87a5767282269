"""How an error message from Triton or a model process is classed (`errors.parse`): what a client can retry
(`unavailable`) apart from what it must change (`invalid_argument`) or a fault of the server (`internal`)."""

import pytest

from s2tts import errors


@pytest.mark.parametrize("message, code", [
    ("Request for unknown model: 'slow_ar' is not found", "unavailable"),
    ("Failed to process the request(s) for model 's2pro', message: Stub process 's2pro_0_0' is not healthy.",
     "unavailable"),
    ("[s2tts:invalid_argument:text] text is empty", "invalid_argument"),
    ("something broke in a way nobody foresaw", "internal"),
])
def test_untagged_and_tagged_messages_get_their_class(message, code):
    assert errors.parse(message).code == code
    assert errors.parse(message).retryable == (code in errors.RETRYABLE)


def test_a_call_while_the_server_stops_is_its_shutdown_not_a_model_fault():
    """tritonserver's answer to a BLS call made while it stops: `unavailable` marked as a shutdown (s2pro then ends
    the request at once instead of reloading the model it called)."""
    err = errors.parse("Server not ready")
    assert err.code == "unavailable" and err.param == errors.SHUTDOWN and "shutting down" in err.message
