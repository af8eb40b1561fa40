"""The logprob recompute as CUDA-graph replays (``algo.cuda_graph_logprobs``).

The recompute is a no-grad forward per micro-batch with one input shape. Eagerly, the host launches every
kernel of every layer each time (~40 per layer with FP8's quantizers), and on the H200 a forward over 4K
tokens of an 8B layer is short enough that the GPU waits on it (``jetrl bench train --profile``: jet's pass
ran 447 ms of wall time over 349 ms of kernels at 8 layers). Here the first micro-batch of a shape runs
eagerly (it also warms up Triton and cuBLAS), the second is captured into a graph together with the fused
log-probability kernel, and it and the rest are replays after copying their tokens into the graph's input
buffers. Same kernels, same bytes as the eager pass (tested on the H200). The graph and its memory pool
are freed at the end of the pass, so the training step's peak memory is unchanged; the weights are read
where they live (the optimizer, the FP8 refresh and ``Actor.release_weights`` never move what the forward
reads within a pass).
"""
from __future__ import annotations

import logging
from typing import Callable, Optional

import torch

log = logging.getLogger("jetrl")
_FAILED: list = []


def applicable(model, n_same: int) -> bool:
    """Whether the pass over ``n_same`` micro-batches of one shape can and should run as replays."""
    if _FAILED or n_same < 3 or not torch.cuda.is_available():
        return False
    from megatron.core import parallel_state

    from megatron_jetrl.rollout.decode import unwrap

    gpt = unwrap(model)
    cfg = getattr(gpt, "config", None)
    return (next(gpt.parameters()).is_cuda and cfg is not None and not getattr(cfg, "num_moe_experts", None)
            and parallel_state.get_tensor_model_parallel_world_size() == 1
            and parallel_state.get_pipeline_model_parallel_world_size() == 1
            and parallel_state.get_context_parallel_world_size() == 1)


def replay_logprobs(model, tokens: list[torch.Tensor], forward: Callable[[torch.Tensor, torch.Tensor, torch.Tensor],
                    torch.Tensor]) -> Optional[list[torch.Tensor]]:
    """``forward(input_ids, position_ids, labels) -> logp`` over micro-batches ``tokens`` (each [b, s+1], one
    shape): the first eagerly, the rest as replays of a graph captured on the second. None when the capture
    fails (logged once; the caller runs the pass eagerly and later passes do not try again)."""
    ids = tokens[0][:, :-1].clone()
    labels = tokens[0][:, 1:].clone()
    pos = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the eager micro-batch: torch's recipe warms up on a side stream before capture
        out = [forward(ids, pos, labels).clone()]
    torch.cuda.current_stream().wait_stream(side)
    ids.copy_(tokens[1][:, :-1])
    labels.copy_(tokens[1][:, 1:])
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            static = forward(ids, pos, labels)
    except Exception as e:  # an op that cannot be captured (a host sync, a CPU tensor): eager from now on
        _FAILED.append(repr(e))
        log.warning("algo.cuda_graph_logprobs: the logprob forward could not be captured (%s); running it "
                    "eagerly (set algo.cuda_graph_logprobs=false to silence this)", str(e).splitlines()[0][:200])
        del graph
        torch.cuda.synchronize()
        return None
    for i, t in enumerate(tokens[1:], 1):
        if i > 1:
            ids.copy_(t[:, :-1])
            labels.copy_(t[:, 1:])
        graph.replay()
        out.append(static.clone())
    del graph, static
    return out
