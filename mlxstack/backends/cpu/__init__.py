"""The CPU backend (backends/cpu/backend.py) and everything only it uses: the fast exp and the
attention / SiLU hooks (fast_math.py, kernels.py), the native kernels (native/*.c, built by
native_build.py ahead with ``mlxstack build-native`` or at load; bound by native_attention.py and
native_products.py), the host path (host_forward.py) and the opt-in block-causal prefill
attention (block_causal.py). Imported lazily by ``select`` (backends/__init__.py); the engine and
the scheduler never import it."""
