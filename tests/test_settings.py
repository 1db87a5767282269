"""The one settings schema: templates, rendering, the models' defaults and docs/SETTINGS.md all agree with it."""

import re
from pathlib import Path

import numpy as np
import pytest

from s2tts import settings as S
from s2tts.errors import S2Error
from s2tts.repository import MODEL_REPOSITORY, PBTXT_BLOCK, TRT_REPOSITORY, parse_model_config, render_repository

ROOT = Path(__file__).resolve().parents[1]
PARAM = re.compile(r'key: "([a-z_0-9]+)" value \{ string_value: "\$\{([a-z_0-9]+)\}" \}')
RENDER_INTERNAL = {"engine_dir", "engine_device", "max_batch_size"}  # filled by the TensorRT rendering itself


def test_settings_doc_table_is_the_schema():
    doc = (ROOT / "docs" / "SETTINGS.md").read_text()
    m = re.search(r"<!-- settings-table:begin -->\n(.*?)\n<!-- settings-table:end -->", doc, re.S)
    assert m, "docs/SETTINGS.md lacks the settings table markers"
    assert m.group(1).strip() == S.markdown_table().strip(), "docs/SETTINGS.md's settings table is stale: regenerate it"


@pytest.mark.parametrize("model", S.MODELS)
def test_each_model_declares_exactly_its_settings(model):
    text = (MODEL_REPOSITORY / model / "config.pbtxt").read_text()
    pairs = PARAM.findall(text)
    assert all(k == v for k, v in pairs), pairs  # the parameter key is the setting's name
    assert {k for k, _ in pairs} == S.model_keys(model)


def test_every_placeholder_is_a_setting():
    for repo in (MODEL_REPOSITORY, TRT_REPOSITORY):
        for cfg in repo.glob("*/config.pbtxt"):
            names = set(re.findall(r"\$\{([a-z_0-9]+)\}", cfg.read_text())) - RENDER_INTERNAL
            assert names <= set(S.SCHEMA), (cfg, names - set(S.SCHEMA))


def test_render_fills_defaults_and_checks(tmp_path, tiny_ckpt):
    repo = render_repository(tmp_path / "r", {"checkpoint": str(tiny_ckpt), "max_batch": "96"})
    cfg = parse_model_config(repo / "fast_ar" / "config.pbtxt")
    assert cfg.parameters["fast_ar_max_batch"].string_value == "96"  # derived from max_batch
    slow = parse_model_config(repo / "slow_ar" / "config.pbtxt")
    assert slow.parameters["cuda_graphs"].string_value == "auto" and slow.parameters["max_queued_requests"].string_value == "64"
    dec = parse_model_config(repo / "dac_decoder" / "config.pbtxt")
    assert dec.parameters["codec_device"].string_value == "auto"  # = device
    assert dec.dynamic_batching.max_queue_delay_microseconds == 3000 == S.SCHEMA["codec_queue_delay_us"].default
    slower = render_repository(tmp_path / "r2", {"checkpoint": str(tiny_ckpt), "codec_queue_delay_us": "12000"})
    assert parse_model_config(slower / "dac_decoder" / "config.pbtxt").dynamic_batching.max_queue_delay_microseconds == 12000
    assert "${" not in "".join(p.read_text() for p in repo.glob("*/config.pbtxt"))
    s2 = parse_model_config(repo / "s2pro" / "config.pbtxt")
    assert s2.parameters["max_new_tokens_limit"].string_value == "2048"  # max_seq_len 4096 / 2 caps nothing


@pytest.mark.parametrize("given,param,words", [
    ({"max_batchh": "4"}, "max_batchh", "unknown setting"),
    ({"max_batch": "four"}, "max_batch", "not a valid int"),
    ({"max_batch": "0"}, "max_batch", "below its minimum 1"),
    ({"dtype": "int8"}, "dtype", "use one of bf16, fp16, fp32"),
    ({"codec_tf32": "maybe"}, "codec_tf32", "true or false"),
    ({"fast_ar": "bls", "max_batch": "128", "fast_ar_max_batch": "64"}, "fast_ar_max_batch", "below max_batch=128"),
    ({"chunk_frames": "300"}, "chunk_frames", "max_chunk_frames=256"),
    ({"max_new_tokens_limit": "5000"}, "max_new_tokens_limit", "below max_seq_len=4096"),
    ({"default_max_new_tokens": "3000"}, "default_max_new_tokens", "above max_new_tokens_limit"),
])
def test_render_refuses_bad_settings(tmp_path, tiny_ckpt, given, param, words):
    with pytest.raises(S2Error) as ei:
        render_repository(tmp_path / "r", {"checkpoint": str(tiny_ckpt), **given})
    assert ei.value.param == param and words in ei.value.message, ei.value.message


def test_small_kv_cache_lowers_the_frame_limits():
    v = S.resolve({"checkpoint": "/c", "max_seq_len": "1024"})
    assert v["max_new_tokens_limit"] == 512 and v["default_max_new_tokens"] == 512


def test_models_read_defaults_from_the_schema():
    cfg = {"parameters": {"checkpoint": {"string_value": "/c"}, "max_batch": {"string_value": "${max_batch}"},
                          "dtype": {"string_value": ""}}}
    v = S.model_values(cfg, "slow_ar")
    assert v.max_batch == S.SCHEMA["max_batch"].default and v.dtype == "bf16" and v.cuda_graphs is None
    f = S.model_values({"parameters": {"checkpoint": {"string_value": "/c"},
                                       "fast_ar_max_batch": {"string_value": "${fast_ar_max_batch}"}}}, "fast_ar")
    assert f.fast_ar_max_batch == S.SCHEMA["max_batch"].default  # unset: what max_batch defaults to
    with pytest.raises(S2Error, match="set the `checkpoint` parameter"):
        S.model_values({"parameters": {}}, "s2pro")


def test_request_fields_share_one_range():
    with pytest.raises(S2Error) as ei:
        S.check_field("temperature", 2.5, http=True)
    assert ei.value.param == "temperature" and "[0, 2]" in ei.value.message
    with pytest.raises(S2Error) as ei:
        S.check_field("max_new_tokens", 600, {"max_new_tokens_limit": 512})
    assert "[1, 512]" in ei.value.message
    assert S.REQUEST_FIELDS["text"].http == "input" and S.REQUEST_FIELDS["reference_audio"].http == "ref_audio"


def test_no_bls_call_reads_a_decoupled_stream():
    """Triton 24.10's Python backend frees a finished decoupled BLS stream without the GIL and can deadlock two
    threads reading such streams (perf/STATUS.md, decisions): every BLS call in the repository is
    request-response, so no model that another model calls may be decoupled."""
    import ast

    from s2tts.layout import DECODER, ENGINE

    called = set()
    for repo in (MODEL_REPOSITORY, TRT_REPOSITORY):
        for f in repo.glob("*/1/model.py"):
            tree = ast.parse(f.read_text())
            for node in ast.walk(tree):
                if isinstance(node, ast.Call) and getattr(node.func, "attr", "") in ("exec", "async_exec"):
                    assert not any(k.arg == "decoupled" for k in node.keywords), f"{f}: {ast.unparse(node)}"
                if isinstance(node, ast.keyword) and node.arg == "model_name" and isinstance(node.value, ast.Constant):
                    called.add(node.value.value)
    assert "dac_encoder" in called
    called |= {ENGINE, DECODER}  # s2pro calls them (and their replicas, same model) by the names s2tts.layout gives
    for name in called:
        cfg = parse_model_config(MODEL_REPOSITORY / name / "config.pbtxt")
        assert not cfg.model_transaction_policy.decoupled, f"{name} is called through BLS but is decoupled"


@pytest.mark.parametrize("model", ["s2pro", "slow_ar"])
def test_request_inputs_of_each_model_are_the_schema(model):
    """The request fields' entries of s2pro's and slow_ar's inputs are generated from REQUEST_FIELDS (`python -m
    s2tts.repository --write-pbtxt`), and Triton reads them as declared."""
    text = (MODEL_REPOSITORY / model / "config.pbtxt").read_text()
    m = PBTXT_BLOCK.search(text)
    assert m, f"{model}/config.pbtxt lacks the request-fields markers"
    assert m.group(2) == S.pbtxt_inputs(model), f"{model}'s request inputs are stale: python -m s2tts.repository --write-pbtxt"
    from tritonclient.grpc import model_config_pb2

    inputs = {i.name: i for i in parse_model_config(MODEL_REPOSITORY / model / "config.pbtxt").input}
    for f in S.REQUEST_FIELDS.values():
        assert (f.name in inputs) == (model in f.stages), f.name
        if f.name in inputs:
            i = inputs[f.name]
            assert model_config_pb2.DataType.Name(i.data_type) == f.triton and i.optional != f.required, f.name


def test_the_client_sends_every_request_field_as_the_schema_declares():
    from s2tts.client import TTSInput, wire_type

    values = dict(text="hi", reference_audio=np.zeros(8, np.float32), reference_sample_rate=16000, reference_text="x",
                  reference_codes=np.zeros((10, 3), np.int32), seed=1, temperature=0.5, top_p=0.9, top_k=5,
                  max_new_tokens=7, first_chunk_frames=2, chunk_frames=4, ignore_eos=True, chunk_length=200,
                  session_id="s", text_event="open")
    s2pro = {f.name: f for f in S.REQUEST_FIELDS.values() if "s2pro" in f.stages}
    assert set(values) == set(s2pro)  # every s2pro field is a TTSInput field (this list follows the schema)
    sent = {t.name(): t for t in TTSInput(**values).to_inputs(check=False)}
    assert set(sent) == set(s2pro)
    for name, t in sent.items():
        f = s2pro[name]
        assert t.datatype() == wire_type(f) == {"TYPE_STRING": "BYTES"}.get(f.triton, f.triton[5:])
        assert len(t.shape()) == (2 if f.dims == "[ -1, -1 ]" else 1), name


def test_each_model_parses_its_request_fields_from_the_schema(harness_factory):
    """s2pro and slow_ar read every request field of their stage as the schema declares it (tritonserver's types,
    `serving.triton_io.read_fields`), a field left out taking the schema's default: the model's setting where the field
    has one (`default_setting`), else the field's own. Given fields reach the request as sent."""
    from fake_triton import Request

    from s2tts.serving import triton_io as tio

    h = harness_factory(first_chunk_frames=3, chunk_frames=5, chunk_length=77, default_max_new_tokens=9)
    s2pro = h.models["s2pro"]
    bare = s2pro._parse(Request({"text": np.array([b"Hello."], object)}))
    for name in ("first_chunk_frames", "chunk_frames", "chunk_length"):
        assert getattr(bare, name) == S.field_default(name, s2pro.values) == {"first_chunk_frames": 3, "chunk_frames": 5,
                                                                               "chunk_length": 77}[name]
    p = bare.params
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k, p.ignore_end) == (9, 0.8, 0.8, 30, False)
    assert S.field_default("temperature") == S.REQUEST_FIELDS["temperature"].default == 0.8
    given = {"text": np.array(["Bonjour.".encode()], object), "seed": np.array([5], np.int64),
             "temperature": np.array([0.5], np.float32), "top_p": np.array([0.5], np.float32),
             "top_k": np.array([7], np.int32), "max_new_tokens": np.array([11], np.int32),
             "first_chunk_frames": np.array([2], np.int32), "chunk_frames": np.array([6], np.int32),
             "ignore_eos": np.array([True]), "chunk_length": np.array([40], np.int32),
             "reference_codes": np.zeros((10, 4), np.int32), "reference_text": np.array([b"Ref."], object)}
    session = {"session_id", "text_event"}  # a text session's fields: tests/test_text_session.py
    assert set(given) | {"reference_audio", "reference_sample_rate"} | session == \
        {f.name for f in S.stage_fields("s2pro")}
    r = s2pro._parse(Request(given))
    assert (r.session_id, r.text_event) == (None, None)
    opened = s2pro._parse(Request({**given, "text": np.array([b""], object), "session_id": np.array([b"s"], object)}))
    assert (opened.session_id, opened.text_event, opened.text) == ("s", "open", "")  # open, with no text yet
    assert (r.text, r.params.seed, r.params.temperature, r.params.top_k, r.params.max_new_tokens) == \
        ("Bonjour.", 5, 0.5, 7, 11)
    assert (r.first_chunk_frames, r.chunk_frames, r.chunk_length, r.params.ignore_end, r.reference_text) == \
        (2, 6, 40, True, "Ref.")
    fields = tio.read_fields(Request(given), "slow_ar", h.models["slow_ar"].values)
    assert set(fields) == {f.name for f in S.stage_fields("slow_ar")} and fields["chunk_frames"] == 6
    assert tio.read_fields(Request({}), "slow_ar", h.models["slow_ar"].values)["first_chunk_frames"] == 3
    with pytest.raises(S2Error) as ei:
        s2pro._parse(Request({**given, "chunk_frames": np.array([0], np.int32)}))
    assert ei.value.param == "chunk_frames"
