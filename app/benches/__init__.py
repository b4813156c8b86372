"""Benchmark scripts behind ``mlxterm bench NAME``: each writes JSON and compares arms in one run."""
