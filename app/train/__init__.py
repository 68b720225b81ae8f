"""The worker's training: the trainer and its step (``trainer``, ``worker``, ``context``, ``inline``), the model,
optimiser, EMA and schedule units (``model``, ``optim``, ``ema``, ``device``, ``accumulate``, ``prefetch``),
validation, checkpoints and the exported model (``evaluate``, ``state``, ``agreement``, ``export``, ``finetune``).

The package shares its name with the API call ``lightray.train(config, **overrides)``: once imported, this
package *is* the attribute ``lightray.train``, so it is made callable and the call runs ``lightray.api.train``.
"""

from __future__ import annotations

import sys
import types
from typing import Any


class _CallablePackage(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """``lightray.train(config, **overrides) -> Result``: see ``lightray.api.train``."""
        from lightray.api import train

        return train(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
