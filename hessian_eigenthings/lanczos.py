"""0.x module path ``hessian_eigenthings.lanczos`` (deprecated; removed in 2.0.0).

``from hessian_eigenthings.lanczos import lanczos`` gives the 0.x function
(it warns when called). The package attribute ``hessian_eigenthings.lanczos``
is the routed top-level function, not this module: the package loads this
module before binding that name, so importing it later does not shadow the
function. Should the module ever be bound there instead, calling it routes
the same way (its type is ``compat.routing.CallableModule``).
"""

import sys

from hessian_eigenthings.compat.lanczos import lanczos
from hessian_eigenthings.compat.routing import CallableModule

sys.modules[__name__].__class__ = CallableModule

__all__ = ["lanczos"]
