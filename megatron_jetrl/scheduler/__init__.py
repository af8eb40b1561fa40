"""How rollout and training share the hardware: ``scheduler.mode`` picks one.

Both expose ``rollout(step) -> (samples, prompts, generations, metrics)`` and
``hand_over(version) -> metrics`` (called after each optimizer step), so the RL step in
``train.py`` does not know which one runs.

- ``Colocated``: engines and trainer on the same GPUs, alternating. With the in-process engine
  nothing moves (it runs the trainer's own model and FP8 cache). With a fleet the trainer's
  params, grads and optimizer state go to host memory for the rollout (``Actor.offload``) and the
  servers release all their GPU memory for training (``/release_memory_occupation``: weights, KV cache,
  CUDA graphs). The hand-over resumes the servers' weights only, next to the trainer's params, and pushes;
  the rollout resumes the rest once the trainer is offloaded. The fleet resumes only tags it released
  (SGLang's scheduler dies on any other).
- ``Disaggregated``: separate pools; weights go over the fleet's transport (a broadcast group by
  default). With ``async_rollout`` the fleet generates step t+1's samples with the weights of step
  t while step t trains; ``rollout_staleness`` logs how many optimizer steps old the samples are.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch


def _cuda_gb() -> float:
    return torch.cuda.memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0


def _model_parallel_group():
    """megatron's model-parallel group (the TP x PP ranks of one DP rank), or None when it is one rank."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized() or not parallel_state.model_parallel_is_initialized():
        return None
    group = parallel_state.get_model_parallel_group()
    return group if dist.get_world_size(group) > 1 else None


def _first_of(group) -> bool:
    import torch.distributed as dist

    return dist.get_rank() == dist.get_process_group_ranks(group)[0]


class _Base:
    def __init__(self, run):
        self.run = run

    def draw(self, step: int):
        from megatron_jetrl.train import encode_prompt, my_prompts

        run = self.run
        samples = my_prompts(run, run.cfg.rollout.prompts_per_step)
        n = run.cfg.rollout.n_samples_per_prompt
        return samples, [encode_prompt(run.tokenizer, s) for s in samples for _ in range(n)]

    def _generate(self, step: int, prompts, params=None):
        """This DP rank's generations (with ``params``, default the run's sampling). The in-process engine runs on every rank (its forward is model
        parallel). A fleet is asked once per DP rank: by the first rank of the model-parallel group (the
        TP x PP ranks that train the same sequences), the others get ``None`` here and the result from
        :meth:`_share`. Each rank asking for itself sent every request TP x PP times (16 times on the 70B
        plan's TP=8 x PP=2) and left the stages' batches equal only as far as the servers' seeded sampling
        is deterministic across batch compositions."""
        from megatron_jetrl.train import _dp

        run = self.run
        params = params or run.sampling
        rank, dp = _dp()
        seed = run.cfg.seed + step * dp + rank  # per step and DP rank: a resumed run samples the same
        if hasattr(run.engine, "push_weights"):
            group = _model_parallel_group()
            if group is not None and not _first_of(group):
                return None
            return run.engine.generate(prompts, params, seed=seed * 1009)
        run.engine.generator.manual_seed(seed)
        return run.engine.generate(prompts, params)

    def evaluate(self, step: int, prompts, params):
        """Generations for held-out ``prompts`` (this DP rank's), with the engine as a rollout runs it; the
        seed stream is apart from the rollouts' (a run with evaluation samples the same rollouts)."""
        return self._share(self._generate(-1 - step, prompts, params))

    def _share(self, gens):
        """A fleet's generations (and its metrics) from the model-parallel group's first rank to the
        others; called on the main thread (a collective: never from the async rollout's worker thread)."""
        import torch.distributed as dist

        run = self.run
        group = _model_parallel_group() if hasattr(run.engine, "push_weights") else None
        if group is None:
            return gens
        src = dist.get_process_group_ranks(group)[0]
        box = [(gens, dict(run.engine.metrics)) if dist.get_rank() == src else None]
        dist.broadcast_object_list(box, src=src, group=group)
        gens, metrics = box[0]
        if dist.get_rank() != src:
            run.engine.metrics = metrics
        return gens

    def stream_state(self) -> dict:
        return self.run.stream.state_dict()

    def close(self) -> None:
        pass


class Colocated(_Base):
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
        from megatron_jetrl.distributed import barrier, is_rank0

        run, m = self.run, {}
        fleet = hasattr(run.engine, "push_weights")
        if fleet and run.cfg.scheduler.offload_trainer:
            m["mem_trainer_gb"] = _cuda_gb()
            run.actor.offload()
            m["trainer_offloaded_gb"] = run.actor.offloaded_bytes() / 2**30
            m["mem_after_offload_gb"] = _cuda_gb()
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
            m.update(run.engine.metrics)
        return gens, m

    def hand_over(self, version: int) -> dict:
        from megatron_jetrl.distributed import is_rank0
        from megatron_jetrl.train import hand_over_weights

        run = self.run
        if hasattr(run.engine, "push_weights"):
            if run.cfg.scheduler.offload_trainer:  # the push needs the params only
                run.actor.offload(("optimizer", "grads"))
            if is_rank0():
                run.engine.resume_memory(["weights"])  # the servers' weights only, next to the trainer's params
        return hand_over_weights(run, version)


class Disaggregated(_Base):
    def __init__(self, run):
        super().__init__(run)
        self.pool = ThreadPoolExecutor(1) if run.cfg.scheduler.async_rollout else None
        self.ahead: Future | None = None
        self._stream_before_ahead: dict | None = None

    def _launch(self, step: int):
        samples, prompts = self.draw(step)
        return samples, prompts, self._generate(step, prompts)

    def rollout(self, step: int):
        run = self.run
        if self.pool is None:
            samples, prompts, gens = self._launch(step)
            gens = self._share(gens)
            return samples, prompts, gens, dict(run.engine.metrics)
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
        from megatron_jetrl.train import hand_over_weights

        if self.ahead is not None:
            self.ahead.result()  # the fleet finishes the in-flight rollout before its weights change
        return hand_over_weights(self.run, version)

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
        if self.pool is not None:
            self.pool.shutdown()


def make_scheduler(run):
    return (Disaggregated if run.cfg.scheduler.mode == "disaggregated" else Colocated)(run)
