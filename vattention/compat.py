"""Deprecated name of :mod:`vattention.integrations.original_api` (the original library's API).

``import vattention.compat`` still works: it warns once (``DeprecationWarning``) and then *is*
``vattention.integrations.original_api``, the same module object, so the process-wide cache it
holds is one whichever name code imports it by.
"""

import sys
import warnings

from .integrations import original_api

warnings.warn(
    "vattention.compat is deprecated: import vattention.integrations.original_api instead",
    DeprecationWarning,
    stacklevel=2,
)
# The import system hands out what sys.modules holds under this name once this body has run:
# every later import of vattention.compat finds the new module there, and never warns again.
sys.modules[__name__] = original_api
