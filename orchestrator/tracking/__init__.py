"""Experiment trackers (MLflow, Weights & Biases) as sinks of the driver's ``MetricsLog``.

``sinks``: which trackers a job asks for (``metrics.mlflow_uri``, ``metrics.wandb_project``), the
check that their optional extras are installed (bad input: exit 2), the background writer that
keeps a slow or unreachable tracker off the step loop, and the stored run ids a resume continues.
``backends``: the two trackers' clients, each behind the same small interface.
"""
