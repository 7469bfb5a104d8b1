"""cag's native CPU kernels: the C++ sources (arch/<instruction set>/, common/: what they share), their build
and verified cache (native, build_cache), and the backend objects that name them (backends)."""
