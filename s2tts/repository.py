"""The model repository, rendered: `model_repository/` (the Python-backend models) copied with its
`${name}` settings filled, and its TensorRT / onnxruntime variants from `model_repository_trt/`.

    render_repository(dst, settings)                 # the Python-backend repository
    render_model_repository(dst, settings)           # + the `backend` switch (python | tensorrt | onnxruntime)
    validate_repository(dst, manifest, reference)    # problems of a rendered repository ([] = valid)

`s2tts.server` serves what this renders (and passes `server_has_tensorrt` for the backend check);
the exported graphs' manifests come from `s2tts.export` (docs/TENSORRT.md). Imports go one way:
server -> repository -> export; export is imported only where a manifest is read (it pulls in torch).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Callable

from tritonclient.grpc import model_config_pb2

from . import settings as schema
from .checkpoint_config import S2Config
from .layout import DECODER, ENCODER, ENGINE, Layout, role_of
from .settings import MODELS  # the repository's models, named once

REPO_ROOT = Path(__file__).resolve().parents[1]
MODEL_REPOSITORY = REPO_ROOT / "model_repository"
_PLACEHOLDER = re.compile(r"\$\{([a-z_0-9]+)\}")


def placeholders(repo: Path = MODEL_REPOSITORY) -> set[str]:
    names = set()
    for cfg in repo.glob("*/config.pbtxt"):
        names |= set(_PLACEHOLDER.findall(cfg.read_text(encoding="utf-8")))
    return names


def render_repository(dst: Path, settings: dict[str, str], src: Path = MODEL_REPOSITORY, models=MODELS) -> Path:
    """Copy the model repository to `dst`, filling every `${key}` from the settings schema (`s2tts.settings`):
    the given values checked (type, range, the rules between models), the rest their defaults. Unknown keys,
    bad values and broken rules raise an error that names what to change."""
    for k, v in settings.items():
        if v is not None and any(c in str(v) for c in '"\n\\'):
            raise schema.invalid(f"setting {k}={v!r} must be a plain value", k)
    values = schema.render_values(settings)
    missing = placeholders(src) - set(values)
    if missing:  # a template names a key the schema lacks: a bug here, not the caller's
        raise RuntimeError(f"config.pbtxt placeholders {sorted(missing)} are not in s2tts.settings.SETTINGS")
    layout = Layout.from_values(values)
    # each model's own device (s2pro keeps the lists: it places requests on the replicas)
    placed = {**{n: {"device": d, "codec_device": layout.codecs[layout.codec_of(i)]}
                 for i, (n, d) in enumerate(layout.models(ENGINE))},
              **{n: {"codec_device": d} for n, d in layout.models(DECODER)},
              "fast_ar": {"device": layout.engines[0]}, ENCODER: {"codec_device": layout.codecs[0]}}
    targets = [(name, name) for name in models] + [(role_of(n), n) for n in layout.replica_models() if role_of(n) in models]
    if values["engine_in_s2pro"] == "true":  # s2pro holds the engine: no slow_ar model
        targets = [(t, n) for t, n in targets if t != ENGINE]
    if dst.exists():
        shutil.rmtree(dst)
    for template, name in targets:
        shutil.copytree(src / template, dst / name, ignore=shutil.ignore_patterns("__pycache__"))
        cfg = dst / name / "config.pbtxt"
        own = {**values, **placed.get(name, {})}
        text = _PLACEHOLDER.sub(lambda m: own[m.group(1)], cfg.read_text(encoding="utf-8"))
        if template == "s2pro":  # a structural field too: how many s2pro processes
            text = re.sub(r"instance_group \[ \{ count: \d+", f"instance_group [ {{ count: {own['s2pro_instances']}", text)
        if template == DECODER:  # a structural field: the template keeps a number (it parses), rendering sets it
            text = re.sub(r"max_queue_delay_microseconds: \d+", f"max_queue_delay_microseconds: {own['codec_queue_delay_us']}", text)
        if name != template:  # a replica: the same model under its own name
            text = re.sub(r'^name: "[^"]*"', f'name: "{name}"', text, count=1, flags=re.M)
        cfg.write_text(text, encoding="utf-8")
    return dst


# --------------------------------------------------------------------------- TensorRT / onnxruntime variants

TRT_REPOSITORY = REPO_ROOT / "model_repository_trt"
BACKENDS = ("python", "tensorrt", "onnxruntime")
BACKEND_SETTINGS = ("backend", "engine_dir")
REPLACED_MODELS = ("fast_ar", "dac_decoder", "dac_encoder")  # same names and contracts as the Python-backend ones
ENGINE_MODELS = {"fast_ar_trt": "fast_ar", "dac_decoder_trt": "dac_decoder_stream", "dac_encoder_trt": "dac_encoder"}  # -> graph
HELPERS = {"fast_ar": ("fast_ar_noise", "fast_ar_trt"), "dac_decoder": ("dac_decoder_trt",), "dac_encoder": ("dac_encoder_trt",)}


def default_engine_dir(checkpoint: str | Path) -> Path:
    return Path(checkpoint) / "engines"


def _fill(text: str, values: dict) -> str:
    return _PLACEHOLDER.sub(lambda m: str(values[m.group(1)]) if m.group(1) in values else m.group(0), text)


def _io_block(kind: str, tensors: list[dict], batched: bool) -> str:
    lines = []
    for t in tensors:
        dims = t["dims"][1:] if batched else t["dims"]
        lines.append(f'  {{ name: "{t["name"]}" data_type: {t["data_type"]} dims: [ {", ".join(map(str, dims))} ] }}')
    return f"{kind} [\n" + ",\n".join(lines) + "\n]\n"


def check_manifest_matches(manifest: dict, checkpoint: str | Path) -> None:
    """The exported graphs must belong to this checkpoint's shapes (codebooks, dims, codebook sizes)."""
    from .codec.loading import (
        codec_codebook_sizes,  # here, not at the top: the codec imports torch
    )

    s2 = S2Config.from_dir(checkpoint)
    want = {"num_codebooks": s2.num_codebooks, "dim": s2.audio.dim, "residual_size": codec_codebook_sizes(checkpoint)[1]}
    for k, v in want.items():
        if k in manifest and manifest[k] != v:
            raise ValueError(f"the exported graphs have {k}={manifest[k]} but checkpoint {checkpoint} has {v}: "
                             f"export them again (python build/export_onnx.py --checkpoint {checkpoint} --out DIR)")


def render_trt_variants(repo: str | Path, settings: dict, backend: str = "tensorrt", engine_dir: str | Path | None = None,
                        require_engines: bool = True) -> list[str]:
    """Turn a rendered Python-backend repository into its TensorRT variant, in place.

    `fast_ar`, `dac_decoder` and `dac_encoder` are replaced by models of the same contract that
    compute through `fast_ar_trt`, `dac_decoder_trt` and `dac_encoder_trt` (TensorRT engines,
    `platform: "tensorrt_plan"`, version 1 linked to ENGINE_DIR/<graph>.plan); their inputs and
    outputs are written from ENGINE_DIR/manifest.json. `backend="onnxruntime"` puts Python-backend
    models running the ONNX graphs (ENGINE_DIR/<graph>.onnx) in the engines' place. Only the models
    the repository holds are replaced (a subset rendered with `models=` stays a subset). Returns the
    names of the models written.
    """
    from .export.driver import (  # here, not at the top: s2tts.export imports torch
        MANIFEST,
        load_manifest,
    )

    if backend not in ("tensorrt", "onnxruntime"):
        raise ValueError(f"backend={backend!r}: render_trt_variants takes tensorrt or onnxruntime")
    repo = Path(repo)
    checkpoint = settings.get("checkpoint")
    if not checkpoint and engine_dir is None:
        raise ValueError("set engine_dir (or checkpoint, whose engines/ directory is the default)")
    engine_dir = Path(engine_dir or default_engine_dir(checkpoint)).resolve()
    manifest = load_manifest(engine_dir)
    if checkpoint:
        check_manifest_matches(manifest, checkpoint)
    present = [m for m in REPLACED_MODELS if (repo / m / "config.pbtxt").is_file()]
    if not present:
        raise ValueError(f"{repo} holds none of {', '.join(REPLACED_MODELS)}: nothing has a TensorRT variant")
    needed = [h for m in present for h in HELPERS[m]]
    missing = [ENGINE_MODELS[h] for h in needed if h in ENGINE_MODELS and ENGINE_MODELS[h] not in manifest["graphs"]]
    if missing:
        raise ValueError(f"{engine_dir / MANIFEST} lacks the graph(s) {missing}: export them (build/export_onnx.py)")
    device = str(settings.get("device", "auto"))
    engine_device = "cpu" if backend == "onnxruntime" else (device if device.startswith("cuda") else "cuda")
    values = {**{k: v for k, v in settings.items() if v is not None}, "engine_dir": str(engine_dir), "engine_device": engine_device}
    written = []
    for name in present + [h for h in needed if h not in ENGINE_MODELS]:
        dst = repo / name
        if dst.exists():
            shutil.rmtree(dst)
        shutil.copytree(TRT_REPOSITORY / name, dst, ignore=shutil.ignore_patterns("__pycache__"))
        (dst / "1").mkdir(exist_ok=True)  # an ensemble loads only with a version directory, even an empty one
        cfg = dst / "config.pbtxt"
        cfg.write_text(_fill(cfg.read_text(encoding="utf-8"), values), encoding="utf-8")
        written.append(name)
    for name in (h for h in needed if h in ENGINE_MODELS):
        graph = ENGINE_MODELS[name]
        spec = manifest["graphs"][graph]
        batch_max = spec["profile"]["sizes"]["batch"][2]
        batched = name != "fast_ar_trt"
        text = _fill((TRT_REPOSITORY / name / "config.pbtxt").read_text(encoding="utf-8"), {"max_batch_size": batch_max if batched else 0})
        text += "\n" + _io_block("input", spec["inputs"], batched) + _io_block("output", spec["outputs"], batched)
        dst = repo / name
        if dst.exists():
            shutil.rmtree(dst)
        (dst / "1").mkdir(parents=True)
        if backend == "tensorrt":
            plan = engine_dir / f"{graph}.plan"
            if plan.is_file():
                (dst / "1" / "model.plan").symlink_to(plan)
            elif require_engines:
                raise FileNotFoundError(f"{plan} not found: build the TensorRT engines first "
                                        f"(build/build_engines.sh {engine_dir} {engine_dir}, see docs/TENSORRT.md)")
        else:
            onnx_file = engine_dir / spec["file"]
            if require_engines and not onnx_file.is_file():
                raise FileNotFoundError(f"{onnx_file} not found: export the graphs (build/export_onnx.py --out {engine_dir})")
            text = text.replace('platform: "tensorrt_plan"', 'backend: "python"').replace("KIND_GPU", "KIND_CPU")
            text += f'\nparameters {{ key: "onnx" value {{ string_value: "{onnx_file}" }} }}\n'
            shutil.copy2(TRT_REPOSITORY / "onnxruntime_model.py", dst / "1" / "model.py")
        (dst / "config.pbtxt").write_text(text, encoding="utf-8")
        written.append(name)
    return written


def split_backend_settings(settings: dict) -> tuple[dict, str, str | None]:
    """(settings for the Python-backend templates, backend, engine_dir). backend=tensorrt/onnxruntime
    makes slow_ar call the fast_ar model (fast_ar=bls) unless fast_ar is set explicitly."""
    settings = dict(settings)
    backend = str(settings.pop("backend", None) or "python").strip().lower()
    engine_dir = settings.pop("engine_dir", None) or None
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: use one of {', '.join(BACKENDS)} (see docs/TENSORRT.md)")
    settings.pop("address", None)  # where tritonserver listens: the launcher's, not a model's
    if backend == "python" and engine_dir:
        raise ValueError("engine_dir is only used with backend=tensorrt or backend=onnxruntime")
    if backend != "python":
        settings.setdefault("fast_ar", "bls")
        settings.setdefault("codec_in_engine", "false")  # their codec is the dac_decoder model
    return settings, backend, engine_dir


def render_model_repository(dst: str | Path, settings: dict, models=None, base=None, require_engines: bool = True,
                            has_tensorrt: Callable[[], bool] | None = None) -> Path:
    """`render_repository` plus the one switch `backend` (python | tensorrt | onnxruntime) and its
    `engine_dir` (default CHECKPOINT/engines). backend=python is exactly render_repository.
    With `has_tensorrt` (`s2tts.server.server_has_tensorrt` when serving), backend=tensorrt first makes
    sure the tritonserver found has the TensorRT backend; None skips that check."""
    base = base or render_repository
    repo_settings, backend, engine_dir = split_backend_settings(settings)
    if backend == "tensorrt" and has_tensorrt is not None and not has_tensorrt():
        raise ValueError("backend=tensorrt needs a tritonserver with the TensorRT backend: run inside the "
                         "nvcr.io/nvidia/tritonserver container (the nvidia-pytriton wheel has only the Python backend); "
                         "backend=onnxruntime runs the same repository without TensorRT")
    if backend != "python":
        if Layout.from_values(repo_settings).replicas > 1:
            raise ValueError(f"backend={backend} runs one engine: several devices (device={settings.get('device')}) "
                             "need backend=python")
    repo = Path(base(Path(dst), repo_settings, models=models or MODELS))
    if backend != "python":
        resolved = {k: v for k, v in schema.render_values(repo_settings).items() if v != ""}
        render_trt_variants(repo, resolved, backend, engine_dir, require_engines=require_engines)
    return repo


def parse_model_config(path: str | Path):
    """config.pbtxt -> tritonclient's ModelConfig message (strict protobuf text format: unknown fields fail)."""
    from google.protobuf import text_format

    return text_format.Parse(Path(path).read_text(encoding="utf-8"), model_config_pb2.ModelConfig())


def _type_name(dtype: int) -> str:
    return model_config_pb2.DataType.Name(dtype)


def _full_dims(cfg, t) -> list[int]:
    return ([-1] if cfg.max_batch_size > 0 else []) + list(t.dims)


def _dims_compatible(a, b) -> bool:
    return len(a) == len(b) and all(x == y or x == -1 or y == -1 for x, y in zip(a, b))


def validate_repository(repo: str | Path, manifest: dict | None = None, reference: str | Path | None = None,
                        require_engines: bool = True) -> list[str]:
    """Problems of a rendered model repository (empty list = valid):

    every config.pbtxt parses as a Triton ModelConfig and names its directory; structural fields
    hold no `${...}`; each model has what its platform loads (1/model.py, 1/model.plan); ensemble
    steps connect existing models with matching names, types and shapes; the engine models'
    inputs/outputs equal the exported graphs' (`manifest`); replaced models keep the contract of
    the `reference` repository (the Python-backend one); BLS targets exist.
    """
    repo = Path(repo)
    problems: list[str] = []
    configs = {}
    for path in sorted(repo.glob("*/config.pbtxt")):
        name = path.parent.name
        text = path.read_text(encoding="utf-8")
        for line in text.splitlines():
            if "${" in line and not line.lstrip().startswith(("parameters", "#")):
                problems.append(f"{name}: unfilled placeholder in `{line.strip()}`")
        try:
            cfg = parse_model_config(path)
        except Exception as e:  # text_format.ParseError
            problems.append(f"{name}: config.pbtxt does not parse: {e}")
            continue
        if cfg.name != name:
            problems.append(f"{name}: config name {cfg.name!r} differs from its directory")
        configs[name] = cfg
    params = {n: {k: v.string_value for k, v in c.parameters.items()} for n, c in configs.items()}
    for name, cfg in configs.items():
        if not (repo / name / "1").is_dir():
            problems.append(f"{name}: no version directory 1/")
        if not cfg.input or not cfg.output:
            problems.append(f"{name}: no inputs or outputs declared")
        for t in [*cfg.input, *cfg.output]:
            if not t.dims:
                problems.append(f"{name}: tensor {t.name} has no dims")
        if cfg.platform == "tensorrt_plan":
            if require_engines and not (repo / name / "1" / "model.plan").is_file():
                problems.append(f"{name}: 1/model.plan missing")
        elif cfg.backend == "python":
            if not (repo / name / "1" / "model.py").is_file():
                problems.append(f"{name}: 1/model.py missing")
        elif cfg.platform == "ensemble":
            problems += _validate_ensemble(name, cfg, configs)
        else:
            problems.append(f"{name}: unexpected platform/backend {cfg.platform or cfg.backend!r}")
        target = params[name].get("engine_model")
        if target and target not in configs:
            problems.append(f"{name}: BLS target {target!r} is not in the repository")
    if "s2pro" in configs:
        try:
            layout = Layout.from_values(params["s2pro"])
            in_s2pro = params["s2pro"].get("engine_in_s2pro") == "true"  # then it holds the engine itself
            callees = [ENCODER] + [n for role in (ENGINE, DECODER) if not (role == ENGINE and in_s2pro)
                                   for n, _ in layout.models(role)]
        except Exception as e:  # noqa: BLE001 - S2Error: a bad device list
            problems.append(f"s2pro: {e}")
            callees = [ENGINE, DECODER, ENCODER]
        problems += [f"s2pro: calls {c!r}, which is not in the repository" for c in callees if c not in configs]
    if "slow_ar" in configs and params["slow_ar"].get("fast_ar") == "bls" and "fast_ar" not in configs:
        problems.append("slow_ar: fast_ar=bls but there is no fast_ar model")
    if manifest is not None:
        for name, graph in ENGINE_MODELS.items():
            if name not in configs:
                continue
            cfg, spec = configs[name], manifest["graphs"][graph]
            for kind, tensors, declared in (("input", spec["inputs"], cfg.input), ("output", spec["outputs"], cfg.output)):
                got = [(t.name, _type_name(t.data_type), _full_dims(cfg, t)) for t in declared]
                want = [(t["name"], t["data_type"], t["dims"]) for t in tensors]
                if got != want:
                    problems.append(f"{name}: {kind}s {got} differ from the graph's {want}")
    if reference is not None:
        for name in REPLACED_MODELS:
            ref_path = Path(reference) / name / "config.pbtxt"
            if name not in configs or not ref_path.is_file():
                continue
            ref, cfg = parse_model_config(ref_path), configs[name]
            sig = lambda c: ([(t.name, t.data_type, list(t.dims), t.optional) for t in c.input],  # noqa: E731
                             [(t.name, t.data_type, list(t.dims)) for t in c.output], c.max_batch_size,
                             c.model_transaction_policy.decoupled)
            if sig(cfg) != sig(ref):
                problems.append(f"{name}: its inputs/outputs/batching differ from the Python-backend model's")
    return problems


def _validate_ensemble(name, cfg, configs) -> list[str]:
    problems = []
    tensors = {t.name: (t.data_type, _full_dims(cfg, t)) for t in cfg.input}
    for i, step in enumerate(cfg.ensemble_scheduling.step):
        m = configs.get(step.model_name)
        if m is None:
            problems.append(f"{name}: step {i} model {step.model_name!r} is not in the repository")
            continue
        m_in = {t.name: t for t in m.input}
        m_out = {t.name: t for t in m.output}
        for key, value in step.input_map.items():
            if key not in m_in:
                problems.append(f"{name}: step {i} maps {key!r}, not an input of {step.model_name}")
            elif value not in tensors:
                problems.append(f"{name}: step {i} reads {value!r} before anything produces it")
            else:
                dtype, dims = tensors[value]
                if dtype != m_in[key].data_type or not _dims_compatible(dims, _full_dims(m, m_in[key])):
                    problems.append(f"{name}: step {i} feeds {value!r} {_type_name(dtype)} {dims} into "
                                    f"{step.model_name}.{key} {_type_name(m_in[key].data_type)} {_full_dims(m, m_in[key])}")
        for t in m.input:
            if not t.optional and t.name not in step.input_map:
                problems.append(f"{name}: step {i} leaves input {step.model_name}.{t.name} unfed")
        for key, value in step.output_map.items():
            if key not in m_out:
                problems.append(f"{name}: step {i} maps {key!r}, not an output of {step.model_name}")
            else:
                tensors[value] = (m_out[key].data_type, _full_dims(m, m_out[key]))
    for t in cfg.output:
        if t.name not in tensors:
            problems.append(f"{name}: output {t.name!r} is produced by no step")
        elif tensors[t.name][0] != t.data_type or not _dims_compatible(tensors[t.name][1], _full_dims(cfg, t)):
            problems.append(f"{name}: output {t.name!r} type/shape differs from the step producing it")
    return problems


PBTXT_BLOCK = re.compile(r"(  # request-fields:begin[^\n]*\n)(.*?)(\n  # request-fields:end)", re.S)


def write_pbtxt_inputs(repository) -> list[str]:
    """Rewrite the request-fields block of each model's config.pbtxt under `repository` from `pbtxt_inputs` ->
    the models whose file changed."""
    changed = []
    for stage in sorted({st for f in schema.REQUEST_FIELDS.values() for st in f.stages}):
        path = Path(repository) / stage / "config.pbtxt"
        text = path.read_text(encoding="utf-8")
        new = PBTXT_BLOCK.sub(lambda m: m.group(1) + schema.pbtxt_inputs(stage) + m.group(3), text)
        if new != text:
            path.write_text(new, encoding="utf-8")
            changed.append(stage)
    return changed


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--write-pbtxt"]:
        print("rewritten:", write_pbtxt_inputs(MODEL_REPOSITORY) or "none (up to date)")
    elif sys.argv[1:2] == ["--pbtxt"] and len(sys.argv) == 3:
        print(schema.pbtxt_inputs(sys.argv[2]))
    else:
        sys.exit("usage: python -m s2tts.repository --write-pbtxt | --pbtxt <model>")

