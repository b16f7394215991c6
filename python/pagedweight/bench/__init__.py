"""Benchmark support: run SGLang servers side by side, drive load against them and record what they did.

Used by benchmark/pressure_bench.py and benchmark/longbench_pressure.py, and by the end-to-end tests."""
