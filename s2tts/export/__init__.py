"""ONNX graphs of the DAC codec and the fast AR, their manifest, their onnxruntime checks, and the
Triton glue the TensorRT variants' models use. The variants of the model repository themselves are
rendered by `s2tts.repository` (which reads the manifest written here).

- `onnx_graphs`: the graphs as PyTorch modules, `export_graph`;
- `driver`: `export_all` (every graph and `manifest.json`), `load_manifest`;
- `checks`: each graph against PyTorch (onnxruntime), the TensorRT operator lint;
- `runtime`: onnxruntime sessions, `GraphStreamCodec`, the BLS glue of the variant models.

    python build/export_onnx.py --checkpoint DIR --out build/onnx      # graphs + manifest.json + check report
    bash build/build_engines.sh build/onnx build/engines                # inside nvcr.io/nvidia/tritonserver:<yy.mm>-py3
    python -m s2tts.server --checkpoint DIR --set backend=tensorrt --set engine_dir=build/engines

Graphs (opset 18, TorchScript exporter, fp32 weights; TensorRT picks reduced-precision kernels
at build time). B batch, C codebooks (10), V residual codebook size, F frames, T samples:

| file                    | inputs                                                                  | outputs                        |
|-------------------------|-------------------------------------------------------------------------|--------------------------------|
| fast_ar.onnx            | hidden FP32 [B, dim], code0 INT32 [B], temperature FP32 [B], top_p FP32 [B], top_k INT32 [B], uniforms FP32 [B, C-1, V] | codes INT32 [B, C-1] |
| fast_ar_seeded.onnx     | as fast_ar, with seed INT64 [B], step INT64 [B] instead of uniforms     | codes INT32 [B, C-1]           |
| dac_decoder.onnx        | codes INT32 [B, C, F]                                                   | audio FP32 [B, F*2048]         |
| dac_decoder_stream.onnx | codes INT32 [B, C, F], state_<key> ...                                  | audio FP32 [B, F*2048], new_state_<key> ... |
| dac_encoder.onnx        | waveform FP32 [B, 1, T], T a multiple of 2048                           | codes INT32 [B, C, T/2048]     |

The fast-AR graph runs all C-1 codebooks with their sampling in one graph. Its random
numbers are those of `s2tts.ar.sampling.uniform(seed, step, 1 + k, V)` for codebook k: either
given as `uniforms` (fast_ar.onnx; TensorRT has no integer XOR, so the counter hash is
computed beside it) or hashed in the graph (fast_ar_seeded.onnx; onnxruntime only).
Same inputs give the same codes as `InProcessFastAR`.

The codec graphs use an export-friendly windowed transformer (a precomputed RoPE table
instead of `torch.polar`, window-chunked attention as one gathered batch instead of a
Python loop over chunks); every other module is the codec's own.
"""
