"""Tools around the engine, which the engine never imports: throughput benchmarks
(throughput.py, the modes of bench.py; bench_prefix.py, bench_hf.py, serve_bench.py,
kernel_bench.py), the accuracy harness (accuracy.py), the kept-positions plot
(plot_kept.py) and the GPU report (gpu_report.py)."""
