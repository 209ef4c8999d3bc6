"""`minidsa bench`: the offline and online serving benchmarks and the GPU decode suite."""
