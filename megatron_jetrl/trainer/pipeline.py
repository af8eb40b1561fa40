"""One call to run micro-batches through megatron-core's (pipeline) schedule.

``run_microbatches`` hides the schedule protocol: each micro-batch is a dict with ``tokens``
[b, s], ``position_ids`` [b, s] and, for a loss, ``labels`` [b, s] (the model then returns the
per-token negative log-likelihood, computed with vocab-parallel cross entropy over TP ranks).
``loss_func(mb, output) -> (loss, {name: tensor})`` runs on the last pipeline stage; the list of
its dicts comes back there (empty elsewhere).
"""
from __future__ import annotations

from functools import partial
from typing import Callable


def run_microbatches(model, microbatches: list[dict], loss_func: Callable, forward_only: bool) -> list[dict]:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def step(data_iterator, model):
        mb = next(data_iterator)
        out = model(mb["tokens"], mb["position_ids"], mb.get("attention_mask"), labels=mb.get("labels"))
        return out, partial(loss_func, mb)

    b, s = microbatches[0]["tokens"].shape
    return get_forward_backward_func()(
        forward_step_func=step, data_iterator=iter(microbatches), model=[model],
        num_microbatches=len(microbatches), seq_length=s, micro_batch_size=b, forward_only=forward_only)
