"""LiveKit's Fish Audio TTS (`livekit-plugins-fishaudio`, unmodified) against the gateway; run by
tests/test_fish_api.py with the separate environment scripts/test.sh makes for it (.venv/livekit: LiveKit pins a
protobuf that tritonclient cannot use). No LiveKit server or cloud: only the plugin's TTS object, as an agent uses it.

    python tests/livekit_client.py <gateway url> <api key> <out.pcm>

`synthesize` (POST /v1/tts) writes its audio to out.pcm (16-bit, 24 kHz); then two `stream`s (the live WebSocket,
text pushed word by word; the plugin pools the connection, so the second session reuses the first's socket). Prints
JSON: each call's sample rate and sample count."""

import asyncio
import json
import sys

import aiohttp
import numpy as np
from livekit.plugins import fishaudio


async def main(url: str, key: str, out: str) -> None:
    got = {"streams": []}
    async with aiohttp.ClientSession() as http:
        # greedy (temperature 0): the same audio every time, as the test's own request at 24 kHz
        tts = fishaudio.TTS(api_key=key, base_url=url, model="s2-pro", voice_id=None, output_format="pcm",
                            sample_rate=24000, http_session=http, max_new_tokens=8, temperature=0.0)
        frames = [ev.frame async for ev in tts.synthesize("Hello from LiveKit.")]
        pcm = np.concatenate([np.frombuffer(f.data, np.int16) for f in frames])
        pcm.tofile(out)
        got["chunked"] = {"rate": frames[0].sample_rate, "samples": int(pcm.size)}
        for words in (["First ", "sentence here. ", "Second ", "one follows."], ["Again, ", "a new stream."]):
            stream = tts.stream()
            for w in words:
                stream.push_text(w)
            stream.end_input()
            frames = [ev.frame async for ev in stream]
            got["streams"].append({"rate": frames[0].sample_rate,
                                   "samples": sum(f.samples_per_channel for f in frames)})
        await tts.aclose()
    print(json.dumps(got))


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
