"""Prefect flows. The work is done by plain functions in tasks/; their
loggers (`eagle3.*`) are routed into the Prefect task-run logs."""
import logging
import os

# What scripts/*.sh set, as defaults for every entry point (`python -m
# flows.extract`, a worker importing a flow), before Prefect is imported: no
# telemetry (offline it fails loudly, and its heartbeat can lock the
# temporary server's SQLite database), no model hub (models are local
# folders). A user's own settings win.
for _name, _value in (("PREFECT_SERVER_ANALYTICS_ENABLED", "false"), ("DO_NOT_TRACK", "1"),
                      ("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"),
                      ("PREFECT_LOGGING_EXTRA_LOGGERS", "eagle3")):
    os.environ.setdefault(_name, _value)
logging.getLogger("eagle3").setLevel(logging.INFO)
