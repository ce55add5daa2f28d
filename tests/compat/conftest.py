"""Temporary: the facade needs hessian_eigenthings.algorithms.power_iteration, which is not in the tree yet."""

import importlib.util

if importlib.util.find_spec("hessian_eigenthings.algorithms.power_iteration") is None:
    collect_ignore_glob = ["test_*.py"]
