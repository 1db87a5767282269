"""The generation engine, laid out as the best LLM engines are (vLLM's v1 engine core, SGLang's scheduler):

- `core.Engine`: the loop a serving thread drives (`submit` / `cancel` from any thread into one ordered command
  queue; `step()` on the engine's thread: take commands, schedule, run, process results, return outputs);
- `scheduler.Scheduler`: plain Python, no device: queues, slots, the KV block pool (`paged.BlockPool`), the prefix
  cache (`prefix_cache.PrefixCache`), preemption and chunked prefill -> a typed `StepPlan` per step;
- `runner.ModelRunner`: the device: KV pools, per-slot sampling state, passes over the slow AR, sampling and the
  fast AR, CUDA graphs -> a `StepResult` per plan;
- `config.EngineConfig`: what an engine is told, built once from the settings (`EngineConfig.from_values`);
- `service.EngineService`: the serving loop around it (responses, the request table, the codec in the loop with
  `codec_plan.plan_codec` deciding what to decode), built from a model's settings by `build.serve_engine`.
"""

from .config import EngineConfig
from .core import Engine
from .runner import HostFastAR, InProcessFastAR, ModelRunner
from .scheduler import (FINISH_CANCELLED, FINISH_END, FINISH_ERROR, FINISH_LENGTH, Output, PrefillChunk, Request,
                        Scheduler, StepPlan, StepResult)

__all__ = ["Engine", "EngineConfig", "ModelRunner", "Scheduler", "InProcessFastAR", "HostFastAR", "Output", "Request",
           "PrefillChunk", "StepPlan", "StepResult", "FINISH_END", "FINISH_LENGTH", "FINISH_CANCELLED", "FINISH_ERROR"]
