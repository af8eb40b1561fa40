"""How rollout and training share the hardware: ``scheduler.mode`` picks one.

Each mode exposes ``rollout(step) -> (samples, prompts, generations, metrics)``, ``evaluate(step, prompts,
params)`` and ``hand_over(version) -> metrics`` (called after each optimizer step) over a
``rollout.base.RolloutEngine``, so the RL step in ``train.py`` does not know which one runs.

- ``Colocated``: engines and trainer on the same GPUs, alternating. With the in-process engine
  nothing moves (it runs the trainer's own model and FP8 cache). With a fleet the trainer's
  params, grads and optimizer state go to host memory for the rollout (``Actor.offload``) and the
  servers release all their GPU memory for training (``/release_memory_occupation``: weights, KV cache,
  CUDA graphs). The hand-over resumes the servers' weights only, next to the trainer's params, and pushes;
  the rollout resumes the rest once the trainer is offloaded. The fleet resumes only tags it released
  (SGLang's scheduler dies on any other).
- ``Disaggregated``: separate pools; weights go over the fleet's transport (a broadcast group by
  default) after every optimizer step.
- ``AsyncDisaggregated`` (``async_rollout``): the fleet generates step t+1's samples with the weights of
  step t while step t trains; ``rollout_staleness`` logs how many optimizer steps old the samples are.
"""
from __future__ import annotations

from megatron_jetrl.scheduler.asynchronous import AsyncDisaggregated
from megatron_jetrl.scheduler.base import Scheduler
from megatron_jetrl.scheduler.colocated import Colocated
from megatron_jetrl.scheduler.disaggregated import Disaggregated

__all__ = ["AsyncDisaggregated", "Colocated", "Disaggregated", "Scheduler", "make_scheduler"]


def make_scheduler(run) -> Scheduler:
    s = run.cfg.scheduler
    if s.mode == "colocated":
        return Colocated(run)
    return (AsyncDisaggregated if s.async_rollout else Disaggregated)(run)
