"""Prefect flows. The work is done by plain functions in tasks/; their
loggers (`eagle3.*`) are routed into the Prefect task-run logs."""
import logging
import os

os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "eagle3")
logging.getLogger("eagle3").setLevel(logging.INFO)
