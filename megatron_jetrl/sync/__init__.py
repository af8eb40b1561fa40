"""Weights from the trainer to the rollout: gathering and HF naming (``export.py``), bucketing and the in-process
and disk transports (``transport.py``), the fleet's tensor and broadcast transports (``server_push.py``), SGLang's
bucket class and checksums (``sglang_bucket.py``, ``sglang_checksum.py``), the hand-over (``handover.py``)."""
