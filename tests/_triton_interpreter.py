"""Triton's interpreter without its repeated patching of ``triton.language`` (test time only).

Under ``TRITON_INTERPRET=1`` a launch patches ``triton.language`` for NumPy (``_patch_lang``:
``inspect.getmembers`` over the language modules, every builtin wrapped) and restores it after
the grid. A call of a ``@triton.jit`` function inside the kernel patches again, and never
restores: Triton's own ``tl.sum``, ``tl.max``, ``tl.zeros_like`` are such functions, ~5 ms a
call, called per column block. In one profile of the suite that re-patching was 64 of the 195
CPU seconds spent in the interpreter.

Within one grid a repeated patch of the same language modules changes nothing: the builtins
are wrapped already (``_patch_builtin`` skips what is no longer a builtin) and the rest is set
again to equal closures. So here the first patch of each set of language modules (a function's
``tl`` / ``tl.core`` globals) in a grid is Triton's own; a repeat in the same grid is skipped.
Each launch starts afresh. What a kernel computes is unchanged; the tests check it against
the float64 oracle as before.

Installed by ``tests/conftest.py`` in the test processes and, through the forkserver's preload,
in the torch ranks they fork. A Triton whose interpreter lacks these names runs unchanged.
"""

import os

__all__ = ["installed"]

installed = False

if os.environ.get("TRITON_INTERPRET") == "1":
    try:
        import triton.language as _tl
        from triton.runtime import interpreter as _interp
    except ImportError:  # no triton: nothing to speed up
        _interp = None
    if _interp is not None and hasattr(_interp, "_patch_lang") and hasattr(_interp, "GridExecutor"):
        _patch_lang = _interp._patch_lang
        _grid_call = _interp.GridExecutor.__call__
        _patched = set()  # the language-module sets patched in the running grid

        class _Unpatched:
            """The scope of a skipped patch: nothing to restore."""

            def restore(self):
                pass

        def _patch_lang_once_per_grid(fn):
            key = frozenset(id(v) for v in fn.__globals__.values() if v is _tl or v is _tl.core)
            if key in _patched:
                return _Unpatched()
            scope = _patch_lang(fn)
            _patched.add(key)
            return scope

        def _grid_call_afresh(self, *args, **kwargs):
            _patched.clear()
            try:
                return _grid_call(self, *args, **kwargs)
            finally:
                _patched.clear()

        _interp._patch_lang = _patch_lang_once_per_grid
        _interp.GridExecutor.__call__ = _grid_call_afresh
        installed = True
