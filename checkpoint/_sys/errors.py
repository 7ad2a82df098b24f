"""The root of the launcher's error tree and the error of the torch-internals registry below it.

They sit under both packages because the registry (``checkpoint._sys.torch_internals``) raises one; the
launcher's error tree keeps its public home in ``elastic.api``, which re-exports both.
"""


class SpotrunError(Exception):
    """Base of every error spotrun's launcher raises on purpose."""


class TorchInternalsError(SpotrunError, AssertionError):
    """A private torch hook or attribute the agent relies on is missing or changed (torch newer than verified)."""
