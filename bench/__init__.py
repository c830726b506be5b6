"""Benchmarks: the engine, the sampler, the whole stack, the dashboard and the GPU script, apart from the product."""
