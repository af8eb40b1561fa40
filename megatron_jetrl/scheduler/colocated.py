"""Colocated: engines and trainer on the same GPUs, alternating.

With the in-process engine nothing moves (it runs the trainer's own model and FP8 cache). With a fleet the
trainer's params, grads and optimizer state go to host memory for the rollout (``Actor.offload``) and the
servers release all their GPU memory for training (``/release_memory_occupation``: weights, KV cache, CUDA
graphs). The hand-over resumes the servers' weights only, next to the trainer's params, and pushes; the rollout
resumes the rest once the trainer is offloaded. The fleet resumes only tags it released (SGLang's scheduler
dies on any other).
"""
from __future__ import annotations

from megatron_jetrl.distributed import barrier, is_rank0
from megatron_jetrl.scheduler.base import Scheduler, cuda_gb
from megatron_jetrl.sync import handover


class Colocated(Scheduler):
    """With a fleet and several trainer ranks, only global rank 0 releases/resumes the servers,
    between barriers: no rank's generation can meet a server another rank already released."""

    def rollout(self, step: int):
        samples, prompts = self.draw(step)
        gens, m = self._on_servers(lambda: self._generate(step, prompts))
        return samples, prompts, gens, m

    def evaluate(self, step: int, prompts, params):
        return self._on_servers(lambda: self._generate(-1 - step, prompts, params))[0]

    def _on_servers(self, generate):
        """``generate()`` with the GPUs handed to the servers: the trainer offloaded, the servers' memory resumed,
        then the other way back. Returns (generations shared in the model-parallel group, metrics)."""
        run, m = self.run, {}
        fleet = run.engine.remote
        if fleet and run.cfg.scheduler.offload_trainer:
            m["mem_trainer_gb"] = cuda_gb()
            run.actor.offload()
            m["trainer_offloaded_gb"] = run.actor.offloaded_bytes() / 2**30
            m["mem_after_offload_gb"] = cuda_gb()
        if fleet:
            if is_rank0():
                run.engine.resume_memory()  # KV pool and CUDA graphs (weights too, before any push) once the trainer is off
            barrier()
        gens = generate()
        if fleet:
            barrier()
            gens = self._share(gens)
            if is_rank0():
                run.engine.release_memory()
            if run.cfg.scheduler.offload_trainer:
                run.actor.reload()
        m.update(run.engine.metrics)  # a fleet's health; the in-process engine's decode waves
        return gens, m

    def hand_over(self, version: int) -> dict:
        run = self.run
        if run.engine.remote:
            if run.cfg.scheduler.offload_trainer:  # the push needs the params only
                run.actor.offload(("optimizer", "grads"))
            if is_rank0():
                run.engine.resume_memory(["weights"])  # the servers' weights only, next to the trainer's params
        return handover.hand_over_weights(run, version)
