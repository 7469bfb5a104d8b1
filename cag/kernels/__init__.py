"""cag's native CPU kernels: the C++ sources, their build and verified cache (native, build_cache),
and the one-call decoder layers seam (one_call)."""
