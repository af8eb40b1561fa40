"""Errors that end a run with one line (the CLI prints the message, no traceback)."""


class TrainingError(RuntimeError):
    """The run cannot go on: non-finite weights, gradients or logits."""


class ConfigError(ValueError):
    """A bad configuration value; the message is one line: field, problem, fix."""


class RunComplete(Exception):
    """A resumed run whose newest checkpoint is its last step: nothing is left to train (the CLI prints the
    message and exits 0, so a chain of batch jobs ends quietly)."""
