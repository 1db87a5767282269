"""How an error message from Triton or a model process is classed (`errors.parse`): what a client can retry
(`unavailable`) apart from what it must change (`invalid_argument`) or a fault of the server (`internal`)."""

import pytest

from s2tts import errors


@pytest.mark.parametrize("message, code", [
    ("Server not ready", "unavailable"),  # tritonserver stopping: a BLS call in flight gets these words
    ("Request for unknown model: 'slow_ar' is not found", "unavailable"),
    ("Failed to process the request(s) for model 's2pro', message: Stub process 's2pro_0_0' is not healthy.",
     "unavailable"),
    ("[s2tts:invalid_argument:text] text is empty", "invalid_argument"),
    ("something broke in a way nobody foresaw", "internal"),
])
def test_untagged_and_tagged_messages_get_their_class(message, code):
    assert errors.parse(message).code == code
    assert errors.parse(message).retryable == (code in errors.RETRYABLE)
