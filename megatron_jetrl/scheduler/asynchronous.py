"""Asynchronous (``scheduler.mode=disaggregated`` with ``scheduler.async_rollout``): the fleet generates step
t+1's samples with the weights of step t while step t trains, one step off-policy; ``rollout_staleness`` logs
how many optimizer steps old the samples are. A checkpoint saves the prompt stream from before the rollout in
flight, so a resumed run draws (and trains on) those prompts again.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

from megatron_jetrl.scheduler.disaggregated import Disaggregated
from megatron_jetrl.sync import handover


class AsyncDisaggregated(Disaggregated):
    def __init__(self, run):
        super().__init__(run)
        self.pool = ThreadPoolExecutor(1)
        self.ahead: Future | None = None
        self._stream_before_ahead: dict | None = None

    def rollout(self, step: int):
        run = self.run
        t0 = time.perf_counter()
        if self.ahead is None:  # first step (or after a resume): nothing in flight yet
            self._stream_before_ahead = run.stream.state_dict()
            self.ahead = self.pool.submit(self._launch, step)
        samples, prompts, gens = self.ahead.result()
        gens = self._share(gens)  # here, on the main thread: a collective
        m = {"rollout_wait_s": time.perf_counter() - t0, **run.engine.metrics}
        # Next step's rollout runs on the fleet (with the weights it has now) while this one trains
        # (not after the last step: nothing would consume it).
        self.ahead = None
        if step + 1 < run.cfg.algo.sft_warmup_steps + run.cfg.steps:
            self._stream_before_ahead = run.stream.state_dict()
            self.ahead = self.pool.submit(self._launch, step + 1)
        m["rollout_staleness"] = float(step - min(g.weight_version for g in gens))  # weights of step v = v updates
        return samples, prompts, gens, m

    def hand_over(self, version: int) -> dict:
        if self.ahead is not None:
            self.ahead.result()  # the fleet finishes the in-flight rollout before its weights change
        return handover.hand_over_weights(self.run, version)

    def stream_state(self) -> dict:
        # A checkpoint must not skip the prompts drawn for the rollout in flight: save the position
        # before they were drawn, so a resumed run draws (and trains on) them again.
        return self._stream_before_ahead if self.ahead is not None else self.run.stream.state_dict()

    def close(self) -> None:
        if self.ahead is not None:
            try:
                self.ahead.result()
            except Exception:  # noqa: BLE001 - shutting down anyway
                pass
        self.pool.shutdown()
