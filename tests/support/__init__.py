"""Helpers shared by the test modules; not tests themselves (pytest collects ``test_*.py`` only).

Test modules import them as ``support.<module>``: pytest puts ``tests/`` on ``sys.path`` (the
rootdir-relative "prepend" import mode, ``tests/`` has no ``__init__.py``).

``cuda_setup``            which CUDA backend the suite runs (real driver, EMULATION, none); loaded
                          by ``conftest.py`` before any cache exists
``cuda_testing``          the emulation-only CUDA tests' ``emu`` fixture, cache factory, snapshots
``helpers``               data patterns, host views of cache memory, fault injection, page state
``share_helpers``         bit-exact patterns and paged caches for the sharing and swap tests
``fake_kvcache``          a pure-Python stand-in for the core, for the memory benchmark's tests
``vllm_harness``          vLLM runs in fresh processes of the vLLM venv
``near_ties``             where two engines' greedy tokens part, judged by the reference's logprobs
``compile_decode_check``  a script, run by ``test_compile.py`` in a subprocess (a compiled graph
                          that reads unmapped memory kills that process, not pytest)
"""
