"""Re-form in place (``elastic.worker.inplace``): ``inplace.run(train, ...)``; docs/concepts/reform-in-place.md."""

from elastic.api import InPlaceFallback as InPlaceFallback
from elastic.worker.inplace import Generation as Generation
from elastic.worker.inplace import InPlaceConfig as InPlaceConfig
from elastic.worker.inplace import InPlaceFallbackError as InPlaceFallbackError
from elastic.worker.inplace import run as run

__all__ = ["Generation", "InPlaceConfig", "InPlaceFallback", "InPlaceFallbackError", "run"]
