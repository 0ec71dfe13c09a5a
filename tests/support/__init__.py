"""Helpers shared by test modules of several directories.

``tests/`` is on ``sys.path`` in every run that collects under it (``pytest tests``,
``scripts/vllm_env.sh test``, ``scripts/vllm_cpu_env.sh test``): pytest's default ``prepend``
import mode puts the directory of the package-less ``tests/conftest.py`` there. So a test
module anywhere below imports these as ``from support.arithmetic import cdiv``.
"""
