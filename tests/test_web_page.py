"""The gateway's web page in a real browser: headless Chromium (Debian's `chromium` + `chromium-driver`, which
`.ci/run` installs) driven by Selenium, against a real gateway and tritonserver (tiny checkpoint, CPU), with the
API key on. The page must stream (audio reaches its Web Audio graph before the response ends), register and
delete a voice, and show the API's own error message. A screenshot is written for people to look at
(`web_page.png` in the test's temporary folder, or in $S2TTS_SCREENSHOT_DIR)."""

import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from servers import gateway_in

webdriver = pytest.importorskip("selenium.webdriver")
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import Select  # noqa: E402

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(not (CHROMIUM and DRIVER), reason="needs Debian's chromium and chromium-driver "
                                "(apt-get install chromium chromium-driver; .ci/run does)")
KEY = "page-key"
FRAME = 2048


@pytest.fixture(scope="module")
def page_gw(triton_server, tmp_path_factory):
    with gateway_in(triton_server.grpc_url, tmp_path_factory.mktemp("page"), "--api-key", KEY) as g:
        yield g


@pytest.fixture
def browser():
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
              "--autoplay-policy=no-user-gesture-required", "--window-size=1000,1200",
              "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream"):  # a fake microphone
        opts.add_argument(a)
    b = webdriver.Chrome(options=opts, service=webdriver.ChromeService(executable_path=DRIVER))
    b.set_script_timeout(120)
    yield b
    b.quit()


def _wait(fn, timeout=120, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = fn()
        if v:
            return v
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _set(b, element_id, value):
    el = b.find_element(By.ID, element_id)
    el.clear()
    el.send_keys(str(value))


def _speak(b):
    b.find_element(By.ID, "speak").click()
    return _wait(lambda: b.execute_script("return window.s2.responseDone && window.s2"), what="the response to end")


def test_page_streams_registers_voices_and_shows_errors(page_gw, browser, tmp_path):
    b = browser
    b.get(page_gw.url + "/")  # the page itself needs no key: it asks for it
    assert b.title == "S2 Pro text to speech"
    # without the key the API's words are shown
    _wait(lambda: "API key" in b.find_element(By.ID, "error").text, 30, "the missing-key error")
    _set(b, "apikey", KEY)
    b.execute_script("document.getElementById('apikey').dispatchEvent(new Event('change'))")

    # speak: audio reaches the Web Audio graph while the response is still coming
    _set(b, "text", "Hello from the web page.")
    _set(b, "seed", 21)
    _set(b, "max_new_tokens", 60)
    _set(b, "top_k", 30)
    s = _speak(b)
    assert b.find_element(By.ID, "error").text == ""
    assert s["samplesScheduled"] % FRAME == 0 and 0 < s["samplesScheduled"] <= 60 * FRAME
    times = s["scheduledAtMs"]
    # played in pieces as they came, the first before the response ended (the order of the page's own events)
    assert len(times) >= 3 and s["firstAudioMs"] < s["responseEndMs"] and times == sorted(times)
    assert s["lastBlobBytes"] == 44 + 2 * s["samplesScheduled"]  # the download is the whole take as WAV
    assert b.find_element(By.ID, "download").is_displayed()
    assert "first audio" in b.find_element(By.ID, "ttfa").text and "real-time factor" in b.find_element(By.ID, "rtf").text

    # register a voice from a file, speak with it, delete it
    t = np.arange(int(24000 * 1.5)) / 24000
    clip = tmp_path / "hum.wav"
    sf.write(clip, (0.3 * np.sin(2 * np.pi * 180 * t)).astype(np.float32), 24000, subtype="PCM_16")
    _set(b, "vname", "hummer")
    _set(b, "vtext", "A hummed tone.")
    b.find_element(By.ID, "vfile").send_keys(str(clip))
    b.find_element(By.ID, "vadd").click()
    _wait(lambda: "added hummer" in b.find_element(By.ID, "vstatus").text, 120, "the voice to be added")
    assert Select(b.find_element(By.ID, "voice")).first_selected_option.text == "hummer"
    rows = b.find_elements(By.CSS_SELECTOR, "#voices tr")
    assert len(rows) == 1 and "A hummed tone." in rows[0].text
    _set(b, "max_new_tokens", 12)
    s = _speak(b)
    assert b.find_element(By.ID, "error").text == "" and s["samplesScheduled"] > 0
    shot = Path(os.environ.get("S2TTS_SCREENSHOT_DIR", tmp_path)) / "web_page.png"
    shot.parent.mkdir(parents=True, exist_ok=True)
    b.save_screenshot(str(shot))
    assert shot.stat().st_size > 10_000
    print(f"screenshot: {shot}")
    rows[0].find_element(By.TAG_NAME, "button").click()
    _wait(lambda: not b.find_elements(By.CSS_SELECTOR, "#voices tr"), 30, "the voice to be deleted")

    # record a reference with the (fake) microphone and register it
    b.execute_script("document.getElementById('vfile').value = ''")
    b.find_element(By.ID, "vrecord").click()
    _wait(lambda: b.find_element(By.ID, "vrecord").text == "Stop recording", 30, "recording to start")
    time.sleep(2.5)
    b.find_element(By.ID, "vrecord").click()
    _wait(lambda: "recorded" in b.find_element(By.ID, "vstatus").text, 30, "the recording")
    _set(b, "vname", "mic")
    _set(b, "vtext", "A beep from the fake microphone.")
    b.find_element(By.ID, "vadd").click()
    _wait(lambda: "added mic" in b.find_element(By.ID, "vstatus").text or b.find_element(By.ID, "error").text,
          120, "the recorded voice")
    assert b.find_element(By.ID, "error").text == ""
    assert [r.text.split()[0] for r in b.find_elements(By.CSS_SELECTOR, "#voices tr")] == ["mic"]

    # a bad request: the API's message, on the page
    _set(b, "temperature", 5)
    s = _speak(b)
    err = b.find_element(By.ID, "error").text
    assert "temperature" in err and "[invalid_value, temperature]" in err, err
    assert s["samplesScheduled"] == 0


def _state(b):
    return b.find_element(By.ID, "state").text


def test_page_live_modes_replay_typing_and_stop(page_gw, browser):
    """The page's live mode over /v1/tts/live (a WebSocket, the key offered as a subprotocol): a text replayed word
    by word is heard before its last word is sent; typed text is spoken while the session is open; the take can be
    replayed in a player; Stop ends the session and silences what was queued; an error clears on the next success."""
    b = browser
    b.get(page_gw.url + "/")
    _set(b, "apikey", "a-wrong-key")
    b.execute_script("document.getElementById('apikey').dispatchEvent(new Event('change'))")
    _set(b, "text", "First sentence is here. Second one comes after it. Third closes.")
    _set(b, "seed", 5)
    _set(b, "max_new_tokens", 8)
    _set(b, "wps", 2)
    b.find_element(By.ID, "replay").click()
    _wait(lambda: b.execute_script("return window.s2.responseDone"), 60, "the refused session")
    assert "API key" in b.find_element(By.ID, "error").text and _state(b) == "error"

    _set(b, "apikey", KEY)
    b.execute_script("document.getElementById('apikey').dispatchEvent(new Event('change'))")
    b.find_element(By.ID, "replay").click()
    _wait(lambda: _state(b).startswith("live"), 30, "the session to open")
    s = _wait(lambda: b.execute_script("return window.s2.responseDone && window.s2"), what="the replay to end")
    assert b.find_element(By.ID, "error").text == "" and _state(b) == "done"  # the last error cleared
    assert s["replaySentMs"] is not None and s["firstAudioMs"] < s["replaySentMs"], s  # heard while text came
    assert 0 < s["samplesScheduled"] <= 3 * 8 * FRAME and s["samplesScheduled"] % FRAME == 0
    assert s["lastBlobBytes"] == 44 + 2 * s["samplesScheduled"]
    duration = _wait(lambda: b.execute_script(
        "const p = document.getElementById('player'); return isFinite(p.duration) && p.duration > 0 && p.duration"),
        30, "the player to load the take")
    assert abs(duration - s["samplesScheduled"] / 44100) < 0.01 and b.find_element(By.ID, "player").is_displayed()

    # typing: spoken once a sentence has ended, while the session is still open
    _set(b, "text", "")
    b.find_element(By.ID, "livetype").click()
    _wait(lambda: _state(b) == "live: waiting for text", 30, "the typing session to open")
    b.find_element(By.ID, "text").send_keys("Typed into the page. ")
    _wait(lambda: b.execute_script("return window.s2.samplesScheduled") > 0, 60, "speech of the typed sentence")
    assert not b.execute_script("return window.s2.responseDone")
    b.find_element(By.ID, "text").send_keys("And finished")
    b.find_element(By.ID, "livetype").click()  # Finish: the rest is spoken, then the session ends
    s = _wait(lambda: b.execute_script("return window.s2.responseDone && window.s2"), what="the typing session to end")
    assert _state(b) == "done" and b.find_element(By.ID, "error").text == "" and s["samplesScheduled"] > 0

    # Stop: the session ends and nothing queued plays on
    _set(b, "max_new_tokens", 200)
    _set(b, "wps", 20)
    b.find_element(By.ID, "replay").click()
    _wait(lambda: b.execute_script("return window.s2.playing") > 0, 60, "audio queued to play")
    b.find_element(By.ID, "stop").click()
    _wait(lambda: _state(b) == "stopped", 30, "the stop")
    assert b.execute_script("return window.s2.playing") == 0
    heard = b.execute_script("return window.s2.samplesScheduled")
    time.sleep(1.0)
    assert b.execute_script("return window.s2.samplesScheduled") == heard  # nothing more came
    import httpx

    _wait(lambda: httpx.get(f"{page_gw.url}/health", timeout=10).json()["in_flight"] == 0, 30,
          "the gateway to end the session")
