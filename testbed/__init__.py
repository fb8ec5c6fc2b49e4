"""The helpers the tests and the benchmarks share (never a test module: ``bench/`` may import this package,
not ``tests/``, and no test imports another test module or a conftest).

* ``rank_pool``: the one pool of local rank processes; ``world.run_mesh`` runs a (dp, pp, tp) mesh of
  ``RankRuntime`` ranks on it, ``gloo_world.run_world`` / ``run_ranks`` any function on n gloo ranks.
* ``reference``: the one cached single-process reference and ``assert_matches_reference``;
  ``mesh_cases``: the small model and step count of the mesh tests.
* ``ray_cluster``, ``ray_harness``, ``fault_runs``: Ray worker groups and clusters, the real controller on
  them, runs with faults armed; ``fake_group``, ``controller_run``: the fake worker group and its harness.
* ``command_line``: the CLI and the bench scripts in a child interpreter; ``config_errors``: a bad config's
  one-line error; ``tiny_tokenizer``, ``hf_models``, ``s3``: a BPE tokenizer, tiny Hugging Face models, a
  local S3 server; ``import_rules``: the layout's import rules.
"""
