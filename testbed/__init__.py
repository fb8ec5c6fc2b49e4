"""The helpers the tests and the benchmarks share (never a test module: ``bench/`` may import this package,
not ``tests/``): spawned gloo meshes and their pool, the single-process references and the comparisons
against them, Ray worker groups and clusters, the fake worker group and the controller harness, a
local S3 server, tiny Hugging Face models, and the layout's import rules."""
