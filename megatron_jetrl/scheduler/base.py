"""The scheduler's common part (``scheduler.mode`` picks a subclass: ``colocated.py``, ``disaggregated.py``,
``asynchronous.py``)."""
from __future__ import annotations

import torch

from megatron_jetrl.distributed import dp_rank_size


def cuda_gb() -> float:
    return torch.cuda.memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0


def model_parallel_group():
    """megatron's model-parallel group (the TP x PP ranks of one DP rank), or None when it is one rank."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized() or not parallel_state.model_parallel_is_initialized():
        return None
    group = parallel_state.get_model_parallel_group()
    return group if dist.get_world_size(group) > 1 else None


def first_of(group) -> bool:
    import torch.distributed as dist

    return dist.get_rank() == dist.get_process_group_ranks(group)[0]


class Scheduler:
    """What every mode shares: drawing this DP rank's prompts, generating on the engine (a fleet asked once per
    model-parallel group), sharing a fleet's generations in that group, held-out evaluation."""

    def __init__(self, run):
        self.run = run

    def draw(self, step: int):
        run = self.run
        samples = run.stream.next_share(run.cfg.rollout.prompts_per_step, *dp_rank_size())
        n = run.cfg.rollout.n_samples_per_prompt
        return samples, [run.tokenizer.encode_prompt(s.prompt) for s in samples for _ in range(n)]

    def _generate(self, step: int, prompts, params=None):
        """This DP rank's generations (with ``params``, default the run's sampling). The in-process engine runs on
        every rank (its forward is model parallel). A fleet is asked once per DP rank, by the first rank of the
        model-parallel group (the TP x PP ranks that train the same sequences); the others get ``None`` here and
        the result from :meth:`_share` (each rank asking for itself would send every request TP x PP times and
        leave the stages' batches equal only as far as the servers' seeded sampling is batch invariant)."""
        run = self.run
        params = params or run.sampling
        rank, dp = dp_rank_size()
        seed = run.cfg.seed + step * dp + rank  # per step and DP rank: a resumed run samples the same
        if run.engine.remote:
            group = model_parallel_group()
            if group is not None and not first_of(group):
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
        group = model_parallel_group() if run.engine.remote else None
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
