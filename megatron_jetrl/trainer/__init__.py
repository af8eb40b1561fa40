"""Training: the actor (log-probabilities, train step, offload), the losses as pure functions (``loss.py``),
checkpoints and the run directory rules."""
