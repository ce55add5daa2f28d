"""Performance-parity harness: ``python -m benchmarks run --suite parity``.

Modules: ``timing`` (CUDA-event / wall-clock timer with peak memory),
``adapters`` (the column interface and the plain-PyTorch 0.x-style baseline),
``adapters_core`` (our 1.0 core and 0.x facade), ``adapters_peers``
(hessian-eigenthings 1.0.0a5 and curvlinops, run in a subprocess),
``runner`` (interleaved measurement of columns on one workload), ``worker``
(subprocess entry of a peer column), ``peers`` (wheel download/install and
launching workers), ``report`` (JSON, Markdown, PNG).

Nothing here imports ``hessian_eigenthings`` at module level except
``adapters_core``, so the harness runs against another release of that name.
"""
