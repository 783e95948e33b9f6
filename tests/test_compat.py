"""vattention.compat, the deprecated name of vattention.integrations.original_api: importing it
warns once, naming the new path, and gives the very module of the new path (one global cache)."""

from __future__ import annotations

import importlib
import sys
import warnings

import vattention
import vattention.integrations.original_api as original_api


def test_compat_warns_once_and_is_the_original_api_module(monkeypatch):
    # Forget any earlier import of the old name (another test, a plugin), so its body runs here;
    # monkeypatch puts sys.modules and the package attribute back afterwards.
    monkeypatch.delitem(sys.modules, "vattention.compat", raising=False)
    monkeypatch.delattr(vattention, "compat", raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import vattention.compat as compat

        again = importlib.import_module("vattention.compat")
    deprecations = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert len(deprecations) == 1, [str(w.message) for w in deprecations]
    assert "vattention.integrations.original_api" in str(deprecations[0].message)
    assert deprecations[0].filename == __file__  # points at the importer, not the shim
    assert compat is again is original_api is vattention.compat
    assert vattention.compat.init_kvcache is vattention.integrations.original_api.init_kvcache
    assert sys.modules["vattention.compat"] is original_api
