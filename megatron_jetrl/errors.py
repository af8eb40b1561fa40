"""Errors that end a run with one line (the CLI prints the message, no traceback)."""


class TrainingError(RuntimeError):
    """The run cannot go on: non-finite weights, gradients or logits."""


class ConfigError(ValueError):
    """A bad configuration value; the message is one line: field, problem, fix."""
