"""Rollout engines behind one protocol (``base.RolloutEngine``): the in-process engine (``local.py``) over the
static CUDA-graph decoder (``decode.py``), ``jetrl serve`` (``server.py``), and the SGLang client, launch arguments
and fleet (``sglang.py``); SGLang's seeded sampling rule (``seeded.py``)."""
