"""Disaggregated: separate pools; the weights go over the fleet's transport (a broadcast group by default) after
every optimizer step, and each step's rollout runs with the newest weights."""
from __future__ import annotations

from megatron_jetrl.scheduler.base import Scheduler
from megatron_jetrl.sync import handover


class Disaggregated(Scheduler):
    def _launch(self, step: int):
        samples, prompts = self.draw(step)
        return samples, prompts, self._generate(step, prompts)

    def rollout(self, step: int):
        samples, prompts, gens = self._launch(step)
        gens = self._share(gens)
        return samples, prompts, gens, dict(self.run.engine.metrics)

    def hand_over(self, version: int) -> dict:
        return handover.hand_over_weights(self.run, version)
