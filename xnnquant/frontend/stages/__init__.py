"""The stages of ``xq.export`` and ``xq.check``, one module each, in the order ``api.py`` runs them
(its docstring lists them with what each takes and gives): ``trace``, ``decompose``, ``passes``
(the rewrites themselves are ``frontend/passes/``), ``calibrate``, ``partition``, ``lower``,
``quantize`` (static int8; the rewrite itself is ``frontend/static_int8/``) and ``write``.  The
last stage, the self-check, is ``frontend/selfcheck.py``, which ``api.export`` calls.

Importing this package does not import torch.
"""
