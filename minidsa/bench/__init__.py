"""`minidsa bench`: the offline and online serving benchmarks; `minidsa bench-decode`: the GPU decode suite."""
