"""Telemetry: metrics and their exposition, traces, GPU readings, logs, the access log, health
and the alert thresholds. Imports only the base modules (config, text, exchange, credentials) and
itself; never the meter, billing or the proxy."""
