"""cag's native CPU kernels: the C++ sources, their build and verified cache (native, build_cache),
and the all-layers-in-one-call seam (cag.runtime.all_layers)."""
