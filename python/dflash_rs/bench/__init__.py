"""Per-step CPU cost of dflash-rs's ``Scheduler`` driven through Python like an engine, on the
workload of vLLM's scheduler anchor harness, optionally side by side with vLLM's own scheduler
(``dflash-rs bench --baseline-python PY``; see :mod:`dflash_rs.bench.cli`).

Modules: :mod:`~dflash_rs.bench.workload` (prompt generator), :mod:`~dflash_rs.bench.loop`
(step loop, admission micro-benchmark), :mod:`~dflash_rs.bench.stats` (percentiles, table),
:mod:`~dflash_rs.bench.baseline` (runs ``vllm_driver.py`` in another interpreter),
:mod:`~dflash_rs.bench.cli` (the command). Offline vLLM fixtures for tests and benchmarks:
:mod:`~dflash_rs.bench.offline_models` (config-only model directories, standard library only,
shared with ``vllm_driver.py``) and :mod:`~dflash_rs.bench.offline_vllm` (vLLM configs,
schedulers and requests built on them).
"""
